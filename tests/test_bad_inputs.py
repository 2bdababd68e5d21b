"""Bad input to the core gets a FleetError that says what was given and what to do
(issue 10). One table, read as a list: (case, call, error type, message)."""

import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import jobs, models, tiers
from tests.test_contract_multiprocess import WORKER
from tests.tiers import slow


def _model():
    return fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))


def _loss_step(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _metrics_step(model, x, y):
    pred = model(x)
    return ((pred - y) ** 2).mean(), {"error": jnp.abs(pred - y).mean(), "pred": pred}


X8, Y8 = np.ones((8, 10), np.float32), np.ones((8, 1), np.float32)


def _closed_over_batch():
    """A step that slices a global batch it closes over by its argument's rows."""
    targets = jax.device_put(Y8, fleet.world().batch)  # as fleet.io places a batch

    def step(model, x):
        return ((model(x) - targets[: x.shape[0]]) ** 2).mean()

    return fleet.distributed_step(step)(_model(), X8)


def _closed_over_batch_behind_a_decorator():
    """The same step under a decorator of the user's (functools.wraps)."""
    targets = jax.device_put(np.arange(8, dtype=np.float32)[:, None], fleet.world().batch)

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return fn(*args)
        return wrapper

    @logged
    def step(model, x):
        return ((model(x) - targets[: x.shape[0]]) ** 2).mean()

    return fleet.distributed_step(step)(_model(), X8)


CASES = [
    ("is_collective not a bool",
     lambda: fleet.init(is_collective="no"),
     fleet.FleetConfigError, r"is_collective='no'.*must be True or False"),
    ("NaN bucket size in the strategy",
     lambda: fleet.DistributedStrategy(fuse_grad_size_in_MB=math.nan),
     fleet.FleetConfigError, r"fuse_grad_size_in_MB must be a positive, finite number of MB"),
    ("infinite bucket size in the strategy",
     lambda: fleet.DistributedStrategy(last_comm_group_size_MB=math.inf),
     fleet.FleetConfigError, r"last_comm_group_size_MB must be a positive, finite number"),
    ("NaN bucket size for DataParallel",
     lambda: fleet.DataParallel(models.LinearNet(nnx.Rngs(0)), comm_buffer_size=math.nan),
     fleet.FleetConfigError, r"comm_buffer_size must be a positive, finite number of MB, got nan"),
    ("negative check_replicas_every_n_steps",
     lambda: fleet.DistributedStrategy(check_replicas_every_n_steps=-1),
     fleet.FleetConfigError, r"check_replicas_every_n_steps must be 0 \(off\) or a positive"),
    ("batch arguments of different leading sizes",
     lambda: fleet.distributed_step(_loss_step)(_model(), X8, Y8[:4]),
     fleet.FleetError, r"fails as a single-device step on the global batch \(batch shapes "
                       r"\[\(8, 10\), \(4, 1\)\]\)"),
    ("a batch of 0 rows",
     lambda: fleet.distributed_step(_loss_step)(_model(), X8[:0], Y8[:0]),
     fleet.FleetConfigError, r"the 2nd argument is a batch of 0 rows"),
    ("batch_argnums out of range",
     lambda: fleet.distributed_step(_loss_step, batch_argnums=(1, 5))(_model(), X8, Y8),
     fleet.FleetConfigError, r"batch_argnums=\(1, 5\) names position\(s\) \[5\].*3 positional"),
    ("batch_argnums not ints",
     lambda: fleet.distributed_step(_loss_step, batch_argnums=("x",)),
     fleet.FleetConfigError, r"batch_argnums=\('x',\) must be non-negative ints"),
    ("a batch of strings (issue 22)",
     lambda: fleet.distributed_step(lambda m, x, names: _loss_step(m, x, Y8))(
         _model(), X8, np.array(["a"] * 8)),
     fleet.FleetTypeError, r"the 3rd argument is a numpy array of dtype <U1 \(shape \(8,\)\); a "
                           r"step takes numbers .*strings and objects cannot enter"),
    ("a batch of objects (issue 22)",
     lambda: fleet.distributed_step(lambda m, x, o: _loss_step(m, x, Y8))(
         _model(), X8, np.array([object()] * 8)),
     fleet.FleetTypeError, r"the 3rd argument is a numpy array of dtype object"),
    ("a closed-over batch split over the devices (issue 21)",
     lambda: _closed_over_batch(),
     fleet.FleetError, r"the step reads 'targets', a jax\.Array of shape \(8, 1\) split over "
                       r"devices .*Pass 'targets' to the step as an argument"),
    ("a closed-over batch behind the user's decorator",
     lambda: _closed_over_batch_behind_a_decorator(),
     fleet.FleetError, r"the step reads 'targets', a jax\.Array of shape \(8, 1\) split over "
                       r"devices .*Pass 'targets' to the step as an argument"),
    ("out_reduce of the wrong structure",
     lambda: fleet.distributed_step(_loss_step, out_reduce=("mean", "sum"))(_model(), X8, Y8),
     fleet.FleetConfigError, r"does not match the structure of the step's output"),
    # (JAX's own prefix error, which named output 0 here, is not shown)
    ("out_reduce missing an output",
     lambda: fleet.distributed_step(_metrics_step, out_reduce=(None, {"error": "mean"}))(
         _model(), X8, Y8),
     fleet.FleetConfigError, r"does not match the structure of the step's output "
                             r"\(PyTreeDef.*\): it has no entry for output 1\.pred;"),
    ("out_reduce naming an output the step lacks",
     lambda: fleet.distributed_step(_metrics_step, out_reduce=(
         "mean", {"error": "mean", "pred": "gather", "count": "sum"}))(_model(), X8, Y8),
     fleet.FleetConfigError, r"it names output 1\.count, which the step does not return"),
]


@pytest.mark.parametrize("case, call, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(make_world, case, call, error, message):
    make_world(4)
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("n", tiers.replicas(2, 4))
def test_a_refused_batch_is_refused_again_after_a_good_call(make_world, n):
    """Issue 38, row 2: a batch whose arguments' row counts differ fails as the
    single-device step and is refused. The single-device check ran once per plan,
    so after a good call the same bad batch (new shapes of a known plan) reached
    the per-replica trace: a raw TypeError about the replicas' shapes (4, 1),
    (2, 1) on 2 replicas, and on 4 a step that ran, broadcasting y's replica row
    over x's (the single device refuses it). It is now checked at every new
    shape: the same FleetError each time, nothing changed by a refused call,
    and good calls train as nnx.jit's single-device step."""
    make_world(n)
    (x, y), (x2, y2) = models.batches("linear", 2, 8)
    model = _model()
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    refused = (r"fails as a single-device step on the global batch \(batch shapes "
               r"\[\(8, 10\), \(4, 1\)\]\), so it is refused here too: TypeError: .*"
               r"\(8, 1\), \(4, 1\)")
    for _ in range(2):
        with pytest.raises(fleet.FleetError, match=refused):
            step(model, opt, x, y[:4])
    step(model, opt, x, y)
    for _ in range(2):
        with pytest.raises(fleet.FleetError, match=refused):
            step(model, opt, x2, y2[:4])
    step(model, opt, x2, y2)
    _, want = models.nnx_reference("linear", [(x, y), (x2, y2)])
    assert models.max_diff(models.flat_params(model), want) < 1e-5


def test_nan_in_the_batch_is_named_with_check_nan_inf(make_world):
    """strategy.check_nan_inf raises at the first step with a non-finite loss or
    gradient, naming the leaf, and leaves the state as it was."""
    make_world(4, fleet.DistributedStrategy(check_nan_inf=True))
    model = _model()
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    step(model, optimizer, X8, Y8)
    before = models.flat_params(model)
    bad = X8.copy()
    bad[5, 3] = np.nan
    with pytest.raises(fleet.FleetError, match=r"check_nan_inf: gradient of '_linear\d\.\w+' "
                                               r"holds NaN or infinity after call 2"):
        step(model, optimizer, bad, Y8)
        step.wait()  # the flags are read once back (fleet.sections._finite)
    assert models.max_diff(models.flat_params(model), before) == 0


def test_nan_goes_unnamed_without_check_nan_inf(make_world):
    """The default (off), for contrast: the NaN reaches the parameters."""
    make_world(4)
    model = _model()
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    bad = X8.copy()
    bad[5, 3] = np.nan
    fleet.distributed_step(models.nnx_train_step)(model, optimizer, bad, Y8)
    assert np.isnan(models.flat_params(model)["['_linear1']['kernel']"]).any()


@slow
def test_a_scalar_argument_that_differs_by_process(tmp_path):
    """Replicated step arguments must be equal on every process (2 processes x 2)."""
    job = jobs.two_processes(tmp_path, WORKER, "-", "scalar", timeout=120, ok=False)
    code, log, seconds = job.returncode, job.text(), job.seconds
    assert code != 0, log[-3000:]
    assert "the step ran" not in log
    assert ("the step's 3rd argument is 1.0 on process 1 but 100.0 on process 0" in log
            or "the step's 3rd argument is 100.0 on process 0 but 1.0 on process 1" in log), log[-3000:]
    print(f"per-process scalar: job ended in {seconds:.1f} s")


@slow
def test_state_that_differs_by_process_is_named(tmp_path):
    """A TrainState each process initialised from its own seed: the first call, which
    places it on the mesh, says so (it raised JAX's AssertionError from a check per
    leaf: fleet.step._global_arrays checks them all at once)."""
    job = jobs.two_processes(tmp_path, WORKER, "-", "seed", timeout=120, ok=False)
    code, log, seconds = job.returncode, job.text(), job.seconds
    assert code != 0, log[-3000:]
    assert "the step ran" not in log and "AssertionError" not in log, log[-3000:]
    assert re.search(r"FleetError: the processes passed different values to the step's first "
                     r"call: array \d+ of the \d+ it places from each process's host "
                     r"\(float32\[[\d, ]+\]\) differs between them.*same seed", log), log[-3000:]
    print(f"per-process TrainState: job ended in {seconds:.1f} s")


@slow
def test_a_collective_call_on_one_rank_only(tmp_path):
    """Wrapping the model on rank 0 only: rank 0 does not wait forever; it names the
    call and rank 1 (FLEET_AGREE_TIMEOUT=10 keeps the test short)."""
    job = jobs.two_processes(tmp_path, WORKER, "-", "rank0-only", timeout=120, ok=False,
                             env={"FLEET_AGREE_TIMEOUT": "10"})
    code, log, seconds = job.returncode, job.text(), job.seconds
    assert code != 0, log[-3000:]
    assert "placing replicated state" in log and "rank(s) [1] did not make it" in log, log[-3000:]
    print(f"collective call on one rank: job ended in {seconds:.1f} s")
    assert seconds < 60


def test_configs_set_without_their_switch_warn_naming_it():
    """Issue 22: gradient_merge_configs set while gradient_merge is off changes
    nothing; fleet.init says so, naming the switch (a FleetWarning)."""
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge_configs = {"k_steps": 4}
    with pytest.warns(fleet.FleetWarning, match=r"strategy\.gradient_merge_configs is set "
                                                r"\(.*k_steps=4.*\) but strategy\.gradient_merge "
                                                r"is off, so it has no effect"):
        strategy.check()
    strategy.gradient_merge = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.check()  # on: nothing to say
        fleet.DistributedStrategy().check()  # defaults: nothing to say
