"""The core contract across processes (issue 9, acceptance 1h and 4), through the
real launcher: 2 processes x 2 CPU devices, gloo collectives on loopback."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from tests import models
from tests.workers import contract_train as worker

ROOT = Path(__file__).resolve().parents[1]
FLEETRUN = os.path.join(os.path.dirname(sys.executable), "fleetrun")


def fleetrun(tmp_path, *args, timeout=240, worker="contract_train.py"):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    start = time.monotonic()
    proc = subprocess.run(
        [FLEETRUN, "--nproc_per_node", "2", "--cpu_devices", "2", "--log_dir",
         str(tmp_path / "log"), str(ROOT / "tests/workers" / worker), *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout)
    logs = "".join((tmp_path / "log" / f"workerlog.{r}").read_text() for r in range(2))
    return proc.returncode, proc.stdout + logs, time.monotonic() - start


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


def test_step_shapes_across_two_processes(tmp_path):
    """(a), (b) and (e) on 2 processes x 2 devices equal the single-device steps."""
    out = tmp_path / "result.npz"
    code, log, _ = fleetrun(tmp_path, str(out), "shapes")
    assert code == 0, log[-4000:]
    got = dict(np.load(out))
    expected = {}
    data = models.batches("linear", worker.STEPS, worker.BATCH)
    expected.update({"a" + k: v for k, v in models.nnx_reference("linear", data)[1].items()})
    expected.update({"b" + k: v for k, v in models.linen_reference("linear", data)[1].items()})
    expected.update(mnist_split_reference(models.batches("cnn", 3, worker.BATCH)))
    for prefix in ("a", "b", "egrad", "e"):
        part = {k: v for k, v in got.items() if k.startswith(prefix) and
                not (prefix == "e" and k.startswith("egrad"))}
        ref = {k: v for k, v in expected.items() if k in part}
        d = models.max_diff(part, ref)
        print(f"({prefix}) 2 processes x 2 devices: |fleet - single device| = {d:.2e}")
        assert d < 1e-5, prefix


@pytest.mark.parametrize("fault, field", [
    ("buckets", "'strategy'"),
    ("batch", "'batch shapes (per process)'"),
])
def test_program_guard_names_the_ranks_and_the_field(tmp_path, fault, field):
    """Rank 1 compiles another step: every process raises, naming both ranks and
    the field, and the job ends within 30 s of starting its step."""
    code, log, seconds = fleetrun(tmp_path, "-", fault, timeout=120)
    assert code != 0, log[-3000:]
    assert "the step ran" not in log
    assert f"rank 0 and rank 1 differ in {field}" in log or \
        f"rank 1 and rank 0 differ in {field}" in log, log[-3000:]
    print(f"program guard ({fault}): job ended in {seconds:.1f} s")
    assert seconds < 60
