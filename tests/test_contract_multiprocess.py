"""The core contract across processes (issue 9, acceptance 1h and 4), through the
real launcher: 2 processes x 2 CPU devices, gloo collectives on loopback. The
step shapes' equivalence runs in the one job of tests/test_two_processes.py."""

from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from tests import jobs, models
from tests.tiers import slow
from tests.workers import contract_train as worker

pytestmark = slow  # multi-process fault cases (the program guard)

WORKER = Path(worker.__file__)


def mnist_split_reference(data):
    module = models.LinenCNN()
    params = module.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=module.apply, params=params, tx=optax.sgd(0.1))
    apply, update = jax.jit(worker.apply_model), jax.jit(worker.update_model)
    out = {}
    for i, (x, y) in enumerate(data):
        grads, _, _ = apply(state, x, y)
        if i == 0:
            out.update({"egrad" + k: np.asarray(v) for k, v in models.flat_params(grads).items()})
        state = update(state, grads)
    out.update({"e" + k: v for k, v in models.flat_params(state.params).items()})
    return out


@pytest.mark.parametrize("fault, field", [
    ("buckets", "'strategy'"),
    ("batch", "'batch shapes (per process)'"),
])
def test_program_guard_names_the_ranks_and_the_field(tmp_path, fault, field):
    """Rank 1 compiles another step: every process raises, naming both ranks and
    the field, and the job ends within 30 s of starting its step."""
    job = jobs.two_processes(tmp_path, WORKER, "-", fault, timeout=120, ok=False)
    code, log, seconds = job.returncode, job.text(), job.seconds
    assert code != 0, log[-3000:]
    assert "the step ran" not in log
    assert f"rank 0 and rank 1 differ in {field}" in log or \
        f"rank 1 and rank 0 differ in {field}" in log, log[-3000:]
    print(f"program guard ({fault}): job ended in {seconds:.1f} s")
    assert seconds < 60
