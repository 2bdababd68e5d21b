"""The same-rows rule (``fleet.step._rows``), in one process: which batches every
process may pass identically, and which are refused. The job itself (two real
processes that pass the whole batch and catch the error) is ``same_rows`` in
``tests/test_two_processes.py``; the slow tier adds a script that does not
catch it."""

import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from fleet import FleetError
from fleet.step import _rows
from tests import jobs
from tests.tiers import slow

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 10)).astype(np.float32)
Y = RNG.integers(0, 10, 16)


def prints(*batches):
    """Each process's fingerprint, one batch per process."""
    return [_rows.fingerprint(b) for b in batches]


@pytest.mark.parametrize("batch, distinct", [
    ([X, Y], True),
    ([np.zeros_like(X), np.zeros_like(Y)], False),  # a warm-up batch
    ([np.full((4, 3), np.nan, np.float32)], False),  # NaN rows compare by their bytes
    ([np.zeros((4, 3)), np.arange(4)], True),  # a row is all the leaves' rows together
    ([X[:1], Y[:1]], False),  # one row
    ({"x": np.ones((2, 3), bool), "y": np.array([[True], [False]])}, True),
])
def test_a_batch_holds_distinct_rows_when_any_two_rows_differ(batch, distinct):
    assert _rows.fingerprint(batch)["distinct"] is distinct


def test_the_digest_covers_every_leaf_its_shape_and_dtype():
    base = _rows.fingerprint([X, Y])["digest"]
    assert _rows.fingerprint([X.copy(), Y.copy()])["digest"] == base
    assert _rows.fingerprint([X[::-1], Y])["digest"] != base  # the rows' order counts
    assert _rows.fingerprint([X, Y + 1])["digest"] != base
    assert _rows.fingerprint([X.reshape(8, 20), Y])["digest"] != base
    assert _rows.fingerprint([X.view(np.int32), Y])["digest"] != base
    assert _rows.fingerprint([np.asfortranarray(X), Y])["digest"] == base


def test_leaves_fleet_does_not_place_as_rows_are_not_fingerprinted():
    keys = jax.random.split(jax.random.key(0), 4)
    assert _rows.fingerprint([keys]) is None
    assert _rows.fingerprint([np.array(["a", "b"])]) is None
    assert _rows.fingerprint([keys, X]) == _rows.fingerprint([X])


@pytest.mark.parametrize("batches, verdict", [
    (([X, Y], [X, Y]), _rows.SAME),  # the whole batch on every process
    (([X[:8], Y[:8]], [X[8:], Y[8:]]), _rows.OWN),  # each process its own rows
    (([X[::2], Y[::2]], [X[1::2], Y[1::2]]), _rows.OWN),
    (([X, Y], [X, Y], [X, Y + 1]), _rows.OWN),  # one process of three differs
    (([np.zeros_like(X)], [np.zeros_like(X)]), _rows.UNDECIDED),  # constant rows
    (([X[:1]], [X[:1]]), _rows.UNDECIDED),  # one row each
    (([X, Y],), _rows.OWN),  # one process
])
def test_the_rule(batches, verdict):
    assert _rows.decide(prints(*batches)) == verdict


def test_a_batch_of_global_arrays_only_is_not_checked():
    assert _rows.decide([None, None]) == _rows.OWN


def test_same_rows_raise_naming_the_fix():
    check = _rows.SameRows("train_step")
    with pytest.raises(FleetError, match=(
            r"every process passed the same batch rows to the step 'train_step' \(call 1, "
            r"batch argument\(s\) 2, 3: 16 rows, identical on all 2 processes\).*"
            r"x\[jax.process_index\(\)::jax.process_count\(\)\].*DistributedBatchSampler.*"
            r"global jax.Array")):
        check.check("program", prints([X, Y], [X, Y]), [2, 3], 1)


def test_constant_rows_leave_the_check_open_for_a_few_calls_then_close_it():
    check = _rows.SameRows("train_step")
    constant = prints([np.zeros_like(X)], [np.zeros_like(X)])
    check.check("program", constant, [2], 1)
    for call in range(2, 2 + _rows.RECHECKS):
        assert check.due("program")
        check.check("program", constant, [2], call)
    assert not check.due("program")

    check.check("other", constant, [2], 1)  # a warm-up call, then the whole batch
    assert check.due("other")
    with pytest.raises(FleetError, match=r"\(call 2, batch argument\(s\) 2:"):
        check.check("other", prints([X], [X]), [2], 2)
    check.check("other", prints([X[:8]], [X[8:]]), [2], 3)  # then its own rows
    assert not check.due("other")


def test_a_cifar_sized_batch_costs_milliseconds():
    x = RNG.standard_normal((256, 32, 32, 3)).astype(np.float32)
    y = RNG.integers(0, 10, 256)
    _rows.fingerprint([x, y])
    start = time.perf_counter()
    for _ in range(10):
        _rows.fingerprint([x, y])
    seconds = (time.perf_counter() - start) / 10
    print(f"fingerprint of a 256 x 32 x 32 x 3 float32 batch ({x.nbytes / 1e6:.1f} MB): "
          f"{seconds * 1e3:.2f} ms")
    assert seconds < 0.05


UNCAUGHT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import optax
    from flax import nnx
    import fleet
    from tests import models

    fleet.init(is_collective=True)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    (x, y), = models.batches("linear", 1, 16)
    step(model, optimizer, x, y)  # the whole batch on every process
    print("the step ran", flush=True)
""")


@slow
def test_an_uncaught_refusal_ends_the_job_with_the_error_on_every_process(tmp_path):
    """The four steps as written for one card, under fleetrun: each process's log
    ends in the same-rows FleetError (not a lost key-value store), and the job
    ends within seconds."""
    script = tmp_path / "train.py"
    script.write_text(UNCAUGHT.format(root=str(Path(__file__).resolve().parents[1])))
    job = jobs.two_processes(tmp_path, script, timeout=120, ok=False)
    print(f"an uncaught same-rows refusal: the job ended in {job.seconds:.1f} s")
    assert job.returncode != 0 and job.seconds < 60
    for rank in (0, 1):
        log = job.log(rank)
        assert "the step ran" not in log
        assert "FleetError: every process passed the same batch rows" in log, log[-3000:]
        assert "FleetTimeoutError" not in log
