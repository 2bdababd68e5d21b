"""A first call traces the step at most twice (the one-device reference and the
probe, whose program is the real one: fleet.step._first_trace), a repeated call
with the same shapes not at all, a call with new shapes at most twice again; and
every result is the single-device step's."""

import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from fleet.step import _jitted
from tests import jobs, models, test_random, tiers

TOL = 1e-5


def counted(fn):
    """``fn``, counting its calls (each is a trace of the step)."""
    def step(*args):
        step.calls += 1
        return fn(*args)

    step.calls = 0
    return step


def traces_per_call(step, fn, calls):
    """Each call's result and how often it traced ``fn``."""
    got = []
    for args in calls:
        before = fn.calls
        got.append((step(*args), fn.calls - before))
    return got


@pytest.mark.parametrize("check_nan_inf", [False, True])
def test_a_first_call_traces_twice_a_repeated_call_not_at_all(make_world, check_nan_inf):
    make_world(4, fleet.DistributedStrategy(check_nan_inf=check_nan_inf))
    data = models.batches("linear", 3, 8) + models.batches("linear", 2, 16, seed=1)
    ref_losses, ref_params = models.nnx_reference("linear", data, optax.sgd(0.1))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    train = counted(models.nnx_train_step)
    step = fleet.distributed_step(train)
    got = traces_per_call(step, train, [(model, optimizer, x, y) for x, y in data])
    traced = [n for _, n in got]
    assert traced[0] <= 2 and traced[3] <= 2, traced  # a first call; new shapes
    assert traced[1:3] == [0, 0] and traced[4] == 0, traced  # the fast path
    assert step.trace_count == 2  # one program per shape
    np.testing.assert_allclose([float(loss) for loss, _ in got], ref_losses, atol=TOL)
    assert models.max_diff(models.flat_params(model), ref_params) < TOL


@pytest.mark.parametrize("check_nan_inf", [False, True])
def test_outputs_of_every_form_from_the_probes_program(make_world, check_nan_inf):
    make_world(4, fleet.DistributedStrategy(check_nan_inf=check_nan_inf))
    x, y = models.batches("linear", 1, 8)[0]
    single = models.LinearNet(nnx.Rngs(0))
    out = np.asarray(single(x))

    def evaluate(model, x, y):
        pred = model(x)
        return {"loss": models.loss_of(pred, y), "count": (pred > 0).sum(),
                "per_example": pred, "norm": sum(jnp.sum(p ** 2) for p in jax.tree.leaves(
                    nnx.state(model, nnx.Param))),
                "declared": pred.std()}

    fn = counted(evaluate)
    step = fleet.distributed_step(fn, out_reduce={"declared": "max", "loss": None,
                                                  "count": None, "per_example": None,
                                                  "norm": None})
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    [(result, traced)] = traces_per_call(step, fn, [(model, x, y)])
    assert traced <= 2
    np.testing.assert_allclose(float(result["loss"]), float(models.loss_of(out, y)), atol=TOL)
    assert int(result["count"]) == int((out > 0).sum())
    np.testing.assert_allclose(np.asarray(result["per_example"]), out, atol=TOL)
    norm = sum((np.asarray(p) ** 2).sum() for p in jax.tree.leaves(nnx.state(single, nnx.Param)))
    np.testing.assert_allclose(float(result["norm"]), norm, rtol=1e-5)
    np.testing.assert_allclose(float(result["declared"]),
                               max(out[i:i + 2].std() for i in range(0, 8, 2)), rtol=1e-5)


def test_decisions_other_than_the_assumed_ones_trace_once_more(make_world):
    # Under check_nan_inf the probe's program sums a float scalar inside the body,
    # as it does a mean; a max is stacked instead: the step is traced for real.
    make_world(4, fleet.DistributedStrategy(check_nan_inf=True))
    x, y = models.batches("linear", 1, 8)[0]
    out = np.asarray(models.LinearNet(nnx.Rngs(0))(x))

    def evaluate(model, x, y):
        pred = model(x)
        return models.loss_of(pred, y), jnp.max(pred)

    fn = counted(evaluate)
    step = fleet.distributed_step(fn)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    [((loss, top), traced), (_, again)] = traces_per_call(step, fn, [(model, x, y)] * 2)
    assert (traced, again) == (3, 0)
    np.testing.assert_allclose(float(loss), float(models.loss_of(out, y)), atol=TOL)
    np.testing.assert_allclose(float(top), out.max(), atol=TOL)


def test_a_float_sum_decided_after_the_probe_traces_the_step_twice(make_world):
    # The program compiled while the guards run assumes a float scalar is a mean;
    # a float count is a sum: the probe's program is evaluated once more (the
    # combination outside the body differs), the step is not traced again.
    make_world(4)
    x, y = models.batches("linear", 1, 8)[0]
    out = np.asarray(models.LinearNet(nnx.Rngs(0))(x))

    def evaluate(model, x, y):
        pred = model(x)
        return models.loss_of(pred, y), (pred > 0).sum().astype(jnp.float32)

    fn = counted(evaluate)
    step = fleet.distributed_step(fn)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    [((loss, count), traced), (_, again)] = traces_per_call(step, fn, [(model, x, y)] * 2)
    assert (traced, again, step.trace_count) == (2, 0, 1)
    np.testing.assert_allclose(float(loss), float(models.loss_of(out, y)), atol=TOL)
    assert float(count) == float((out > 0).sum())


def compiles_during(call, *args):
    """``call(*args)``'s result and how many programs XLA compiled meanwhile. The
    listener hears every thread: a refused step's compilation that an earlier test
    left running in the background (``_jitted.abandon``) is waited for first."""
    _jitted._join_abandoned()
    seen = []

    def listener(event, _secs, **_):
        if event == COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        return call(*args), len(seen)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_a_first_call_compiles_its_program_once(make_world):
    # XLA compiles the probe's program while the guards run; the call then runs
    # that executable (jit's cache), and the next calls too.
    make_world(4)
    data = models.batches("linear", 3, 8)
    ref_losses, ref_params = models.nnx_reference("linear", data, optax.sgd(0.1))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    got = [compiles_during(step, model, optimizer, x, y) for x, y in data]
    assert [n for _, n in got] == [1, 0, 0]
    np.testing.assert_allclose([float(loss) for loss, _ in got], ref_losses, atol=TOL)
    assert models.max_diff(models.flat_params(model), ref_params) < TOL


def test_a_step_that_updates_metrics_traces_twice_and_compiles_once(make_world):
    # Flax's MNIST tutorial: metrics.update(loss=loss, logits=logits, labels=y). The
    # probe combines the loss it gives the metric as it guesses (a float scalar: its
    # mean over the replicas); the checks decide a mean, so the program XLA compiled
    # meanwhile is the real one. The metrics' state, made on one device, is placed on
    # the mesh before the first call, as the next calls pass it: they find its program
    # in jit's cache. nnx.jit compiles once too.
    make_world(4)
    data = models.batches("cnn", 3, 8)

    def train(model, optimizer, metrics, x, y):
        def loss_fn(m):
            logits = m(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        metrics.update(loss=loss, logits=logits, labels=y)
        optimizer.update(model, grads)

    def run(step, wrap):
        model, optimizer = models.model_and_optimizer(models.CNN(nnx.Rngs(0)),
                                                      optax.sgd(0.1), wrap)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                  loss=nnx.metrics.Average("loss"))
        counts = [compiles_during(step, model, optimizer, metrics, x, y)[1] for x, y in data]
        if wrap:  # (the metrics' state too: the same on every device)
            assert fleet.check_replicas((model, optimizer, metrics)) == []
        return counts, metrics.compute(), models.flat_params(model)

    ref_counts, ref_metrics, ref_params = run(nnx.jit(train), wrap=False)
    fn = counted(train)
    step = fleet.distributed_step(fn)
    counts, got, params = run(step, wrap=True)
    assert (counts, fn.calls, step.trace_count) == ([1, 0, 0], 2, 1) == (ref_counts, 2, 1)
    np.testing.assert_allclose(float(got["loss"]), float(ref_metrics["loss"]), rtol=1e-6)
    assert float(got["accuracy"]) == float(ref_metrics["accuracy"])
    assert models.max_diff(params, ref_params) < TOL


def linen_script(case):
    """Flax's guides on one device or with fleet: ``run(wrap)`` gives each call's
    loss and compilations, and the final state. A new ``TrainState`` holds
    ``step=0``, a Python int, on the host; the dropout guide passes
    ``state.key``, a leaf of the state, as an argument."""
    from flax.training.train_state import TrainState

    from tests.test_random import LinenDrop, data, linen_state, linen_step

    if case == "dropout guide":
        batches = [({"image": x, "label": y},) for x, y in data(3)]

        def start(wrap):
            module = fleet.distributed_model(LinenDrop()) if wrap else LinenDrop()
            return linen_state(module), linen_step

        def call(step, state, batch):
            return compiles_during(step, state, batch, state.key)
    else:
        batches = models.batches("linear", 3, 8)

        def start(wrap):
            module = models.LinenLinearNet()
            params = module.init(jax.random.key(0), batches[0][0][:1])["params"]
            tx = fleet.distributed_optimizer(optax.adam(0.01)) if wrap else optax.adam(0.01)
            return TrainState.create(apply_fn=module.apply, params=params, tx=tx), \
                models.linen_train_step

        def call(step, state, x, y):
            return compiles_during(step, state, x, y)

    def run(wrap):
        state, fn = start(wrap)
        step = fleet.distributed_step(fn) if wrap else jax.jit(fn)
        got = []
        for batch in batches:
            (state, loss), compiled = call(step, state, *batch)
            got.append((float(loss), compiled))
        return got, state

    return run


@pytest.mark.parametrize("case, n", [("TrainState", 4), ("TrainState", 1),
                                     ("dropout guide", 4), ("NNX, a plain optimizer", 1),
                                     ("NNX, dropout", 4)])
def test_the_calls_after_the_first_compile_nothing(make_world, case, n):
    # Each argument's mesh is part of jit's cache key: a call that passes what the
    # last one returned (arrays on the mesh) must find the first call's program.
    # The first call places what would otherwise differ (fleet.step._global_arrays.
    # placed): a TrainState's step=0 on the host, a mesh of one device, the state's
    # key passed as an argument too, a donated key's copy (fleet.step._donate). A Linen
    # TrainState on raw parameters also compiled twice on its first call (its probe's
    # optimizer did not divide what JAX summed: fleet.step._first_trace.reusable).
    if case.startswith("NNX"):
        if case == "NNX, a plain optimizer":  # (Paddle's low-level path: its state is
            batches, make, fn = models.batches("linear", 3, 8), models.LinearNet, \
                models.nnx_train_step  # made on one device)
        else:  # (nnx.Dropout's key: held twice, so a copy of it is donated)
            batches, make, fn = test_random.data(3), test_random.DropNet, test_random.nnx_step

        def run(wrap):
            model = fleet.distributed_model(make(nnx.Rngs(0))) if wrap else make(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
            step = fleet.distributed_step(fn) if wrap else nnx.jit(fn)
            got = [compiles_during(step, model, optimizer, x, y) for x, y in batches]
            if wrap:
                assert fleet.check_replicas((model, optimizer)) == []
            return [(float(loss), c) for loss, c in got], models.flat_params(model)

        ref, ref_params = run(wrap=False)
        ref_losses = [loss for loss, _ in ref]
        make_world(n)
        got, params = run(wrap=True)
    else:
        run = linen_script(case)
        ref, ref_state = run(wrap=False)
        ref_losses, ref_params = [loss for loss, _ in ref], models.flat_params(ref_state.params)
        make_world(n)
        got, state = run(wrap=True)
        params = models.flat_params(state.params)
        assert fleet.check_replicas(state) == []
        assert [c for _, c in ref] == [1, 0, 0]
    assert [c for _, c in got] == [1, 0, 0], got
    np.testing.assert_allclose([loss for loss, _ in got], ref_losses, rtol=1e-5, atol=TOL)
    assert models.max_diff(params, ref_params) < TOL


def compile_threads():
    return [t for t in threading.enumerate() if t.name == "fleet-compile"]


def test_a_refusal_by_the_guards_does_not_wait_for_the_compilation_and_donates_nothing(
        make_world, monkeypatch):
    # The guards refuse a loss summed over the batch while XLA compiles: the error is
    # raised at once (XLA is held here until it was), the compilation ends in the
    # background, joined at exit, and the state was not donated.
    make_world(4)
    x, y = models.batches("linear", 1, 8)[0]
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    before = models.flat_params(model)
    refused, compile_ = threading.Event(), jax.stages.Lowered.compile

    def held(self, *args, **kwargs):
        refused.wait(timeout=20)
        return compile_(self, *args, **kwargs)

    def train(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).sum())(model)
        optimizer.update(model, grads)
        return loss

    monkeypatch.setattr(jax.stages.Lowered, "compile", held)
    with pytest.raises(fleet.FleetError, match="summed over the batch"):
        fleet.distributed_step(train)(model, optimizer, x, y)
    compiling = compile_threads()
    assert len(compiling) == 1 and not refused.is_set()  # (on its way still)
    assert compiling[0] in _jitted._ABANDONED  # (joined at exit)
    refused.set()
    compiling[0].join()
    assert models.max_diff(models.flat_params(model), before) == 0


REFUSED_AT_EXIT = """
import sys, time
import jax, numpy as np, optax
from flax import nnx
import fleet

compile_ = jax.stages.Lowered.compile

def slow(self, *args, **kwargs):  # (XLA compiling a large model)
    time.sleep(3)
    out = compile_(self, *args, **kwargs)
    print("compiled", file=sys.stderr, flush=True)
    return out

jax.stages.Lowered.compile = slow
fleet.init(is_collective=True)
model = fleet.distributed_model(nnx.Linear(4, 1, rngs=nnx.Rngs(0)))
optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))

@fleet.distributed_step
def train(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).sum())(model)
    optimizer.update(model, grads)
    return loss

train(model, optimizer, np.ones((8, 4), np.float32))
"""


@tiers.slow
def test_a_script_ended_by_a_refusal_exits_after_the_compilation(tmp_path):
    """The refusal ends the script while XLA still compiles (held 3 s here): the
    interpreter waits for it at exit, then exits with the error, not a crash."""
    script = tmp_path / "refused.py"
    script.write_text(REFUSED_AT_EXIT)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=jobs.clean_environ(
                             XLA_FLAGS="--xla_force_host_platform_device_count=4"))
    assert run.returncode == 1, run.stderr
    refusal = run.stderr.index("SummedLossError: the output is a sum over the batch rows")
    assert run.stderr.index("compiled") > refusal  # (the error first, then the wait)
    assert "Fatal Python error" not in run.stderr


class DeepNet(nnx.Module):
    """Residual layers in a Python loop: a chain of thousands of values in the trace."""

    def __init__(self, rngs: nnx.Rngs, layers: int):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = 0.1 * jnp.tanh(layer(x)) + x
        return x


def test_a_deep_model_is_checked_and_trains_as_on_one_device(make_world):
    # (the checks followed the chain by recursion: RecursionError from 50 layers)
    rs = np.random.RandomState(0)
    data = [(rs.randn(8, 4).astype(np.float32), rs.randn(8, 4).astype(np.float32))
            for _ in range(2)]

    def train(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    (ref_losses, ref_params), (losses, params) = models.one_device_and_fleet(
        lambda: DeepNet(nnx.Rngs(0), 100), train, data, make_world)
    np.testing.assert_allclose(losses, ref_losses, atol=TOL)
    assert models.max_diff(params, ref_params) < TOL


def test_a_failed_compilation_is_raised_by_the_call(make_world, monkeypatch):
    make_world(4)
    x, y = models.batches("linear", 1, 8)[0]
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    before = models.flat_params(model)

    def failing(self, *args, **kwargs):
        raise RuntimeError("XLA failed")

    monkeypatch.setattr(jax.stages.Lowered, "compile", failing)
    with pytest.raises(RuntimeError, match="XLA failed"):
        fleet.distributed_step(models.nnx_train_step)(model, optimizer, x, y)
    assert compile_threads() == []
    assert models.max_diff(models.flat_params(model), before) == 0
