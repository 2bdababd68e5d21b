"""Scalar outputs combine by the reduction that made them (issue 33, "Outputs").

Each undeclared scalar a step returns that differs across replicas is read from
the traced step (fleet.semantics._outputs): a mean, a sum, a max or a min over the batch
rows comes back as on one device; a standard deviation or a ratio is refused,
and so is a loss summed over the batch (its gradients would be N times smaller),
returned or only differentiated.
Every case is compared with the single-device step (nnx.jit / jax.jit on the
global batch), parameters included, and fleet.check_replicas is empty after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from tests import models, tiers

DEVICES = tiers.replicas(1, 2, 4, 8)
BATCH, TOL = 16, 1e-5

#: name -> (metric of (logits, labels), out_reduce, the numbers it gives)
METRICS = {
    "max": lambda lg, y: jnp.max(lg),
    "min": lambda lg, y: jnp.min(lg),
    "float count": lambda lg, y: jnp.sum(jnp.argmax(lg, -1) == y).astype(float),
    "float count * 1.0": lambda lg, y: (jnp.argmax(lg, -1) == y).sum() * 1.0,
    "sum": lambda lg, y: lg.sum(),
    "sum / rows": lambda lg, y: lg.sum() / lg.shape[0],
    "sum / global batch": lambda lg, y: lg.sum() / BATCH,
    "mean": lambda lg, y: optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(),
    "accuracy": lambda lg, y: jnp.mean(jnp.argmax(lg, -1) == y),
    "1 - max": lambda lg, y: 1.0 - jnp.max(lg),
    "mean of row maxima": lambda lg, y: lg.max(-1).mean(),
}
REFUSED = {
    # (the reason names the line that computes it: this one)
    "std": (lambda lg, y: jnp.std(lg), r"output \d+ .*\(a sqrt at .*test_outputs\.py:\d+\).*out_reduce"),
    "ratio of sums": (lambda lg, y: lg.sum() / jnp.abs(lg).sum(),
                      r"output \d+ .*a sum over the rows divided by another.*out_reduce"),
    "sqrt of a mean": (lambda lg, y: jnp.sqrt((lg ** 2).mean()), r"output \d+ .*a sqrt"),
    # (its gather is in jnp.median's own jit: the line is the call's)
    "median": (lambda lg, y: jnp.median(lg.max(-1)),
               r"output \d+ .*\(a gather at .*test_outputs\.py:\d+, an indexing: x\[i\], "
               r"jnp\.take, the middle rows jnp\.median picks\).*out_reduce"),
}


def _data():
    x, y = models.batches("cnn", 1, BATCH)[0]
    return x, y


def _nnx_step(metric):
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(
            lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
        optimizer.update(model, grads)
        return loss, metric(model(x), y)
    return step


def _linen_step(metric):
    def step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        # (the metric from the parameters, not from the differentiated logits: a sum
        # of those is refused as a summed loss, see test_summed_aux_metric_is_refused)
        return state.apply_gradients(grads=grads), loss, metric(
            state.apply_fn({"params": state.params}, x), y)
    return step


def _nnx_run(n, step, make_world, out_reduce=None):
    x, y = _data()
    ref_model = models.CNN(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    ref = nnx.jit(step)(ref_model, ref_opt, x, y)
    make_world(n)
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    got = fleet.distributed_step(step, out_reduce=out_reduce)(model, opt, x, y)
    d_params = models.max_diff(models.flat_params(model), models.flat_params(ref_model))
    assert fleet.check_replicas(model) == []
    return got, ref, d_params


def _linen_run(n, step, make_world, out_reduce=None):
    x, y = _data()
    module = models.LinenCNN()
    params = module.init(jax.random.key(0), x[:1])["params"]
    ref_state = TrainState.create(apply_fn=module.apply, params=params, tx=optax.sgd(0.1))
    ref_state, *ref = jax.jit(step)(ref_state, x, y)
    make_world(n)
    model = fleet.distributed_model(module)
    state = TrainState.create(apply_fn=model.apply, params=model.init(
        jax.random.key(0), x[:1])["params"], tx=optax.sgd(0.1))
    state, *got = fleet.distributed_step(step, out_reduce=out_reduce)(state, x, y)
    d_params = models.max_diff(models.flat_params(state.params),
                               models.flat_params(ref_state.params))
    assert fleet.check_replicas(state) == []
    return got, ref, d_params


RUNS = {"nnx": (_nnx_step, _nnx_run), "linen": (_linen_step, _linen_run)}


def _assert_close(label, got, ref, d_params):
    d = max(abs(float(a) - float(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    scale = max(1.0, *(abs(float(b)) for b in jax.tree.leaves(ref)))
    print(f"{label}: |fleet - single device| outputs {d:.2e} (scale {scale:.1f}), "
          f"params {d_params:.2e}")
    assert d <= TOL * scale, label
    assert d_params < TOL, label


def _every_metric(lg, y):
    return {name: metric(lg, y) for name, metric in METRICS.items()}


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_scalar_outputs_as_on_one_device(make_world, n, api):
    """Every metric, undeclared, returned by one step next to a mean loss: the
    numbers and the trained parameters of the single-device step (one step for
    all of them: one compilation)."""
    make_step, run = RUNS[api]
    got, ref, d_params = run(n, make_step(_every_metric), make_world)
    for name in METRICS:
        _assert_close(f"{api} {name} on {n}", got[-1][name], ref[-1][name], d_params)
    _assert_close(f"{api} loss on {n}", got[:-1], ref[:-1], d_params)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_outputs_without_a_combination_are_refused(make_world, n, api, name):
    make_step, run = RUNS[api]
    metric, match = REFUSED[name]
    with pytest.raises(fleet.FleetError, match=match):
        run(n, make_step(metric), make_world)


@pytest.mark.parametrize("n", tiers.replicas(2, 4, 8))
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_an_output_of_the_row_count_through_a_tanh_is_refused_and_its_rewrite_is_exact(
        make_world, n, api):
    """``jnp.tanh(lg / lg.shape[0]).mean()``: the replica's row count inside a tanh, which
    no combination of the replicas' values undoes (0.017 from one device, silently, before
    fleet.semantics._row_count read the outputs too; on one replica it is exact). Divided
    by the global count instead, it equals one device."""
    make_step, run = RUNS[api]
    with pytest.raises(fleet.FleetError, match=(
            rf"output \d, which fleet combines over the {n} replicas, depends on the replica's row "
            r"count other than as a scale: .*test_outputs.py:\d+ divides by the rows the "
            r"replica sees .*test_outputs.py:\d+ puts a value scaled so through a tanh")):
        run(n, make_step(lambda lg, y: jnp.tanh(lg / lg.shape[0]).mean()), make_world)
    got, ref, d_params = run(n, make_step(
        lambda lg, y: jnp.tanh(lg / fleet.all_reduce(lg.shape[0])).mean()), make_world)
    _assert_close(f"{api} tanh of a feature over the global count on {n}", got, ref, d_params)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_refused_output_declared_comes_back_declared(make_world, n, api):
    """The way out the error names: a std declared is combined as declared, the
    replicas' stds (what the user asked: 'max' here), and the step trains as on one device."""
    make_step, run = RUNS[api]
    got, ref, d_params = run(n, make_step(lambda lg, y: jnp.std(lg)), make_world,
                             out_reduce=(None, "max") if api == "nnx" else (None, None, "max"))
    assert d_params < TOL


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_out_reduce_max_min(make_world, n, reduce):
    """out_reduce='max' / 'min' on a per-replica vector (the replicas' elementwise
    max / min) and on a scalar: as on one device."""
    x, y = _data()

    def evaluate(model, x, y):
        logits = model(x)
        red = jnp.max if reduce == "max" else jnp.min
        return red(logits, axis=0), red(jnp.abs(logits))

    ref = nnx.jit(evaluate)(models.CNN(nnx.Rngs(0)), x, y)
    make_world(n)
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    got = fleet.distributed_step(evaluate, out_reduce=reduce)(model, x, y)
    for a, b in zip(got, ref):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert fleet.check_replicas(model) == []


def _summed_nnx(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(
        lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).sum())(model)
    optimizer.update(model, grads)
    return loss


def _summed_linen(state, x, y):
    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(
            state.apply_fn({"params": params}, x), y).sum()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_summed_loss_is_refused(make_world, n, api):
    """A loss summed over the batch would train with gradients N times smaller:
    refused, naming it and saying to use a mean."""
    run = RUNS[api][1]
    step = _summed_nnx if api == "nnx" else _summed_linen
    match = r"output.* is a sum over the batch rows .*Use a mean: `\.mean\(\)`"
    with pytest.raises(fleet.FleetError, match=match):
        run(n, step, make_world)


@pytest.mark.parametrize("n", DEVICES)
def test_summed_metric_from_the_updated_model_is_a_sum(make_world, n):
    """A sum over the batch computed from the parameters after the update (not the
    differentiated value) is a metric: summed, as on one device."""
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(
            lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
        optimizer.update(model, grads)
        return loss, optax.softmax_cross_entropy_with_integer_labels(model(x), y).sum()

    got, ref, d_params = _nnx_run(n, step, make_world)
    _assert_close(f"summed metric on {n}", got, ref, d_params)


@pytest.mark.parametrize("n", DEVICES)
def test_check_nan_inf_keeps_max_and_min(make_world, n):
    """check_nan_inf sums the mean and sum outputs inside the body; max and min
    ones are combined outside, as without it: the same numbers as one device."""
    x, y = _data()

    def evaluate(model, x, y):
        logits = model(x)
        return (logits.mean(), jnp.max(logits), jnp.min(logits), logits.sum(),
                (jnp.argmax(logits, -1) == y).sum().astype(jnp.float32))

    ref = nnx.jit(evaluate)(models.CNN(nnx.Rngs(0)), x, y)
    make_world(n, fleet.DistributedStrategy(check_nan_inf=True))
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    step = fleet.distributed_step(evaluate)
    got = step(model, x, y)
    step.wait()
    assert step._program.records[step._last_plan].summed == (
        [n > 0, False, False, True, True])
    for a, b in zip(got, ref):
        np.testing.assert_allclose(float(a), float(b), rtol=1e-5, atol=1e-5)
    assert fleet.check_replicas(model) == []


@pytest.mark.parametrize("n", DEVICES)
def test_summed_aux_metric_is_refused(make_world, n):
    """What is not caught precisely: a sum over the batch of a value of the
    differentiated forward pass (has_aux logits) is refused as a summed loss even
    when it is only a metric; declaring it (out_reduce) is the way out."""
    def step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss, logits.sum()

    with pytest.raises(fleet.FleetError, match=r"output 2 is a sum over the batch rows"):
        _linen_run(n, step, make_world)
    got, ref, d_params = _linen_run(n, step, make_world, out_reduce=(None, None, "sum"))
    _assert_close(f"declared aux sum on {n}", got, ref, d_params)


def _ce_sum(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()


def _grad_only(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(lambda m: _ce_sum(m(x), y))(model))


def _aux_only(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return _ce_sum(logits, y), logits

    grads, logits = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), jnp.argmax(logits, -1)


def _jitted_loss(model, optimizer, x, y):
    loss_of = jax.jit(_ce_sum)
    optimizer.update(model, nnx.grad(lambda m: loss_of(m(x), y))(model))


def _micro_batches(model, optimizer, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro(grads, xy):
        g = jax.grad(lambda p: _ce_sum(nnx.merge(graphdef, p, rest)(xy[0]), xy[1]))(params)
        return jax.tree.map(jnp.add, grads, g), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(micro, zeros, (x.reshape(2, -1, *x.shape[1:]), y.reshape(2, -1)))
    optimizer.update(model, grads)


#: name -> (api, step, out_reduce): a summed loss the step differentiates and does
#: not return as an undeclared output
UNRETURNED = {
    "nnx.grad alone": ("nnx", _grad_only, None),
    "has_aux, the aux returned": ("linen", _aux_only, None),
    "the loss under jax.jit": ("nnx", _jitted_loss, None),
    "nnx.grad in a lax.scan over micro-batches": ("nnx", _micro_batches, None),
}


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("name", list(UNRETURNED))
def test_summed_loss_not_returned_is_refused(make_world, n, name):
    """A summed loss the step differentiates but does not return would train with
    gradients N times smaller, silently: refused on several replicas, naming the
    line that computes it; on one replica it is the single-device step (nothing to
    refuse). Micro-batches of one row per replica too, where the replica's trace
    and the one-device trace differ in structure (JAX reshapes a one-row reduction
    away): their equations are paired where they run alike
    (fleet.semantics._jaxpr_scope.paired_eqns; a strict xfail before)."""
    api, step, out_reduce = UNRETURNED[name]
    run = RUNS[api][1]
    if n == 1:
        got, ref, d_params = run(n, step, make_world, out_reduce=out_reduce)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert d_params < TOL
        return
    match = (r"the value computed at .*test_outputs\.py:\d+ is a sum over the batch rows .*"
             rf"nothing in the step uses it.*gradients {n} times smaller.*Use a mean")
    with pytest.raises(fleet.FleetError, match=match):
        run(n, step, make_world, out_reduce=out_reduce)


@pytest.mark.parametrize("n", tiers.replicas(2, 4))
def test_summed_loss_given_to_a_metric_is_refused(make_world, n):
    """A summed loss differentiated and given only to a metric: the metric would
    get the right sum, the gradients would still be N times smaller. Refused."""
    def step(model, optimizer, metric, x, y):
        loss, grads = nnx.value_and_grad(lambda m: _ce_sum(m(x), y))(model)
        optimizer.update(model, grads)
        metric.update(loss=loss)

    x, y = _data()
    make_world(n)
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(fleet.FleetError, match=r"test_outputs\.py:\d+ is a sum over the batch"):
        fleet.distributed_step(step)(model, opt, nnx.metrics.Average("loss"), x, y)


def test_a_sum_left_unused_is_refused_saying_so_and_returned_declared_it_is_exact(make_world):
    """A sum over the rows that the step computes and leaves unused (a leftover
    ``total = l.sum()``) looks, in the forward pass, like the loss jax.grad
    differentiates: refused, the message saying that nothing uses it and how to
    keep it (it said "is differentiated" before). Returned and declared
    ``out_reduce='sum'``, the step equals one device."""
    def unused(model, optimizer, x, y):
        def loss_fn(m):
            per_row = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
            total = per_row.sum()  # noqa: F841 (left unused)
            return per_row.mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def returned(model, optimizer, x, y):
        def loss_fn(m):
            per_row = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
            return per_row.mean(), per_row.sum()

        (loss, total), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, total

    data = [_data()]
    make_world(4)
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=r"test_outputs\.py:\d+ is a sum over the batch "
                       r"rows .*nothing in the step uses it.*If the step does not differentiate "
                       r"it .*remove it, or return it and declare it: out_reduce='sum'"):
        fleet.distributed_step(unused)(model, opt, *data[0])
    ref_model = models.CNN(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    want = nnx.jit(returned)(ref_model, ref_opt, *data[0])
    got = fleet.distributed_step(returned, out_reduce=(None, "sum"))(model, opt, *data[0])
    print(f"(loss, total): {got} vs {want}")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert models.max_diff(models.flat_params(model), models.flat_params(ref_model)) < 1e-6
    assert fleet.check_replicas((model, opt)) == []


@tiers.slow  # (14 s cold: 410 terms traced and compiled)
def test_a_loss_of_hundreds_of_terms_is_a_mean_as_on_one_device(make_world):
    """A loss summed term by term in a Python loop (each time step's error, a deep
    model's per-layer terms): a chain of 410 additions. Each term is a mean over
    the rows, so the loss is one. (Followed by recursion, at most 400 deep: refused
    as "too deep to follow".)"""
    steps = 410
    rs = np.random.RandomState(0)
    data = [(rs.randn(8, 10).astype(np.float32), rs.randn(8, steps).astype(np.float32))
            for _ in range(2)]

    def step(model, optimizer, x, y):
        def loss_fn(m):
            error = (m(x) - y) ** 2
            return sum(jnp.mean(error[:, t]) for t in range(steps)) / steps

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    (want, ref_params), (got, params) = models.one_device_and_fleet(
        lambda: nnx.Linear(10, 1, rngs=nnx.Rngs(0)), step, data, make_world)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert models.max_diff(params, ref_params) < 1e-6
