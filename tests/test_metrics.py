"""Stateful metrics updated inside a step (issue 33, item 2): Flax's NNX MNIST
tutorial updates ``nnx.MultiMetric(accuracy=Accuracy(), loss=Average('loss'))``
in its ``train_step``. On N devices the metrics' state -- totals, counts,
Welford's mean and m2 -- must end each step as on one device, not only their
``compute()`` ratio, and the same on every replica."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import tiers

DEVICES = tiers.replicas(1, 2, 4, 8)
STEPS, BATCH = 3, 32


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


def train_step(model, optimizer, metrics, batch):
    """Flax's NNX MNIST tutorial's train_step, as it is written there."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def batches(steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(0)
    return [{"image": rng.normal(size=(batch, 6)).astype(np.float32),
             "label": rng.integers(0, 4, batch).astype(np.int32)} for _ in range(steps)]


def tutorial(step_of, wrap=lambda m, o: (m, o)):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, 0.9), wrt=nnx.Param)
    model, optimizer = wrap(model, optimizer)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                              loss=nnx.metrics.Average("loss"))
    step = step_of(train_step)
    history = []
    for b in batches():
        step(model, optimizer, metrics, b)
        history.append(jax.tree.map(np.asarray, nnx.state(metrics)))
    return model, metrics, history


def metric_state(metrics) -> dict:
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(metrics))}


@pytest.mark.parametrize("n", DEVICES)
def test_the_mnist_tutorial_metrics_equal_one_device(make_world, n):
    _, ref, ref_history = tutorial(nnx.jit)
    make_world(n)
    _, got, history = tutorial(fleet.distributed_step, lambda m, o: (
        fleet.distributed_model(m), fleet.distributed_optimizer(o)))
    want, have = metric_state(ref), metric_state(got)
    print(f"n={n}: {have} vs {want}")
    assert set(want) == set(have)
    for k in want:  # counts exactly, totals within float rounding
        np.testing.assert_allclose(have[k], want[k], rtol=1e-6, err_msg=k)
    assert have["accuracy.count"] == STEPS * BATCH and have["loss.count"] == STEPS
    assert float(have["accuracy.total"]).is_integer()  # a count of correct rows
    for a, b in zip(jax.tree.leaves(history), jax.tree.leaves(ref_history)):
        np.testing.assert_allclose(a, b, rtol=1e-6)  # after every step
    for k, v in got.compute().items():
        np.testing.assert_allclose(v, ref.compute()[k], rtol=1e-6)
    assert fleet.check_replicas(nnx.state(got)) == []


def welford_step(model, welford, x):
    welford.update(values=model(x)[:, 0])


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_welford_equals_one_device(make_world, n):
    """The variance is not a sum: each update must see the global batch."""
    xs = [np.random.default_rng(i).normal(size=(BATCH, 6)).astype(np.float32) for i in range(3)]

    def run(step_of, wrap=lambda m: m):
        model, welford = wrap(MLP(nnx.Rngs(0))), nnx.metrics.Welford("values")
        step = step_of(welford_step)
        for x in xs:
            step(model, welford, x)
        return welford

    ref = run(nnx.jit)
    make_world(n)
    got = run(fleet.distributed_step, fleet.distributed_model)
    want, have = metric_state(ref), metric_state(got)
    print(f"n={n}: {have} vs {want}")
    for k in want:
        np.testing.assert_allclose(have[k], want[k], rtol=1e-5, err_msg=k)
    stats, ref_stats = got.compute(), ref.compute()
    np.testing.assert_allclose(stats.standard_deviation, ref_stats.standard_deviation, rtol=1e-5)
    np.testing.assert_allclose(stats.standard_error_of_mean, ref_stats.standard_error_of_mean,
                               rtol=1e-5)


class Masked(nnx.metrics.Metric):
    """A metric of one's own through the public Metric API: a masked sum and its count."""

    def __init__(self):
        self.total = nnx.metrics.MetricState(np.float32(0))
        self.count = nnx.metrics.MetricState(np.int32(0))

    def reset(self):
        self.total[...], self.count[...] = np.float32(0), np.int32(0)

    def update(self, values, mask):
        self.total[...] += (values * mask).sum()
        self.count[...] += mask.sum().astype(np.int32)

    def compute(self):
        return self.total[...] / self.count[...]


def test_a_metric_subclass_with_positional_arguments_equals_one_device(make_world):
    x = np.random.default_rng(3).normal(size=(BATCH, 6)).astype(np.float32)
    mask = (np.arange(BATCH) % 3 == 0)

    def step(model, metric, x, mask):
        metric.update(model(x)[:, 1], mask)

    ref = Masked()
    nnx.jit(step)(MLP(nnx.Rngs(0)), ref, x, mask)
    make_world(4)
    got = Masked()
    fleet.distributed_step(step)(fleet.distributed_model(MLP(nnx.Rngs(0))), got, x, mask)
    assert int(got.count[...]) == int(ref.count[...]) == mask.sum()
    np.testing.assert_allclose(float(got.total[...]), float(ref.total[...]), rtol=1e-6)


def test_a_metric_given_a_per_replica_array_that_is_not_per_example_is_refused(make_world):
    def step(model, metric, x):
        metric.update(values=model(x).sum(0))  # (4,) per replica: a sum over its rows

    make_world(4)
    # (the message said "per replica" and "the replica's [32] batch rows" of the
    # global batch's numbers, from the one-device check: it now says which rows)
    with pytest.raises(fleet.FleetError, match=r"updates metric Average with a value of shape "
                       rf"\(4,\) for {BATCH} batch rows that differs across replicas"):
        fleet.distributed_step(step)(fleet.distributed_model(MLP(nnx.Rngs(0))),
                                     nnx.metrics.Average("values"),
                                     np.ones((BATCH, 6), np.float32))


class Running(nnx.Module):
    def __init__(self):
        self.loss = nnx.Variable(np.float32(0))


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_other_state_set_from_per_replica_values_is_refused_not_averaged(make_world, n):
    """One rule for state that is neither a metric nor batch-norm statistics: fleet
    cannot tell a mean from a sum, so it refuses (before, it averaged: a sum came
    out N times too small), and fleet.all_reduce is what to write."""

    def silent(running, x):
        running.loss[...] = 0.9 * running.loss[...] + 0.1 * x.sum()

    def explicit(running, x):
        running.loss[...] = 0.9 * running.loss[...] + 0.1 * fleet.all_reduce(x.sum(), "sum")

    x = np.arange(BATCH * 2, dtype=np.float32).reshape(BATCH, 2)
    ref = Running()
    nnx.jit(silent)(ref, x)
    make_world(n)
    if n > 1:
        with pytest.raises(fleet.FleetError, match=r"variable 'loss' would hold different values"
                           r".*fleet.all_reduce\(value, 'sum'\) for a sum"):
            fleet.distributed_step(silent)(Running(), x)
    got = Running()
    fleet.distributed_step(explicit)(got, x)
    assert float(got.loss[...]) == float(ref.loss[...]) == 0.1 * x.sum()


class Seen(nnx.Module):
    def __init__(self):
        self.rows = nnx.Variable(np.int32(0))


COUNTED = (r"variable 'rows' leaves the step the same on every replica, but it is "
           r"computed from the batch's shape")


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_state_counted_from_the_batch_shape_is_refused(make_world, n):
    """A count written from x.shape[0] is the same on every replica, and each
    replica's is its own rows: refused on several replicas (it was the replica's
    count, silently); counted with fleet.all_reduce it is the global count."""

    def silent(seen, x):
        seen.rows[...] += x.shape[0]

    def explicit(seen, x):
        seen.rows[...] += fleet.all_reduce(x.shape[0])

    x = np.ones((BATCH, 2), np.float32)
    make_world(n)
    if n > 1:
        with pytest.raises(fleet.FleetError, match=COUNTED):
            fleet.distributed_step(silent)(Seen(), x)
    got = Seen()
    step = fleet.distributed_step(explicit)
    step(got, x)
    step(got, x)
    assert int(got.rows[...]) == 2 * BATCH


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_state_counted_inside_a_scan_is_refused(make_world, n):
    """The same count made in a jax.lax.scan over micro-batches (each iteration adds
    its rows): refused on several replicas, the way a straight-line count is; a
    step counter in the same loop (adds 1 each iteration) is not a count of rows
    and trains as on one device."""

    def rows_in_loop(seen, x):
        seen.rows[...] = jax.lax.scan(lambda c, mb: (c + mb.shape[0], None), seen.rows[...],
                                      x.reshape(2, -1, *x.shape[1:]))[0]

    def steps_in_loop(seen, x):
        seen.rows[...] = jax.lax.scan(lambda c, mb: (c + 1, None), seen.rows[...],
                                      x.reshape(2, -1, *x.shape[1:]))[0]

    x = np.ones((BATCH, 2), np.float32)
    make_world(n)
    if n > 1:
        with pytest.raises(fleet.FleetError, match=COUNTED):
            fleet.distributed_step(rows_in_loop)(Seen(), x)
    else:
        got = Seen()
        fleet.distributed_step(rows_in_loop)(got, x)
        assert int(got.rows[...]) == BATCH
    got = Seen()
    fleet.distributed_step(steps_in_loop)(got, x)
    assert int(got.rows[...]) == 2


SCALARS = {  # a scalar made from the replica's rows, as the single-device step writes it
    "correct": lambda pred, y: ((pred > 0) == (y > 0)).sum().astype(jnp.float32),
    "summed": lambda pred, y: ((pred - y) ** 2).sum(),
    "worst": lambda pred, y: jnp.max(jnp.abs(pred - y)),
    "best": lambda pred, y: -jnp.max(-jnp.abs(pred - y)),  # a min, through a negation
    "loss": lambda pred, y: ((pred - y) ** 2).mean(),
    "count": lambda pred, y: (pred > y).sum(),  # an integer sum
    "top": lambda pred, y: jnp.max(jnp.argmax(jnp.stack([pred, y], 1), 1)),  # an integer max
}


def scalar_batches(steps=2, batch=BATCH):
    rng = np.random.default_rng(7)
    return [(rng.normal(size=(batch, 6)).astype(np.float32),
             rng.normal(size=batch).astype(np.float32)) for _ in range(steps)]


def run_metrics(step_of, metrics, step, wrap=lambda m: m):
    model = wrap(MLP(nnx.Rngs(0)))
    step = step_of(step)
    for x, y in scalar_batches():
        step(model, metrics, x, y)
    return metrics


def assert_metrics_equal(got, ref):
    want, have = metric_state(ref), metric_state(got)
    print(f"{have} vs {want}")
    assert set(want) == set(have)
    for k in want:  # counts exactly, totals within float rounding
        np.testing.assert_allclose(have[k], want[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(jax.tree.leaves(got.compute()), jax.tree.leaves(ref.compute()),
                               rtol=1e-5)
    assert fleet.check_replicas(nnx.state(got)) == []


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("name", list(SCALARS))
def test_a_scalar_given_to_a_metric_combines_as_its_reduction_over_the_rows(make_world, n,
                                                                            name):
    """A float sum of correct rows, a summed error, a maximum, a minimum, a mean,
    an integer count and an integer maximum, each into an Average: the metric's
    total and count after two steps equal one device's (a sum was averaged over
    the replicas before: N times too small)."""
    def step(model, metric, x, y):
        metric.update(**{name: SCALARS[name](model(x)[:, 0], y)})

    ref = run_metrics(nnx.jit, nnx.metrics.Average(name), step)
    make_world(n)
    got = run_metrics(fleet.distributed_step, nnx.metrics.Average(name), step,
                      fleet.distributed_model)
    assert_metrics_equal(got, ref)


def test_a_multimetric_with_mixed_arguments_equals_one_device(make_world):
    """Per-example logits and labels (gathered), a mean loss, a float count, a
    summed error and a maximum, in one MultiMetric update."""
    def step(model, metrics, x, y):
        out = model(x)
        pred, labels = out[:, 0], (y > 0).astype(jnp.int32)
        metrics.update(logits=out[:, :2], labels=labels, **{
            k: SCALARS[k](pred, y) for k in ("loss", "correct", "summed", "worst")})

    def multi():
        return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), **{
            k: nnx.metrics.Average(k) for k in ("loss", "correct", "summed", "worst")})

    ref = run_metrics(nnx.jit, multi(), step)
    make_world(4)
    got = run_metrics(fleet.distributed_step, multi(), step, fleet.distributed_model)
    assert_metrics_equal(got, ref)
    assert float(metric_state(got)["correct.total"]).is_integer()


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
@pytest.mark.parametrize("value, why", [
    (lambda pred, y: jnp.std(pred - y), "a sqrt"),
    (lambda pred, y: (pred * y).sum() / (y ** 2).sum(), "a sum over the rows divided by another"),
])
def test_a_scalar_given_to_a_metric_that_no_reduction_combines_is_refused(make_world, n, value,
                                                                          why):
    """A standard deviation or a ratio of two sums: no combination of the replicas'
    values is the single-device value; the error names the metric, the argument,
    and what to write instead. Refused on one replica too (read against a trace
    with twice the rows), as a step's scalar output is: the step would be refused
    on more."""
    def step(model, metric, x, y):
        metric.update(spread=value(model(x)[:, 0], y))

    make_world(n)
    x, y = scalar_batches(1)[0]
    with pytest.raises(fleet.FleetError, match=(
            rf"updates metric Average \(argument 'spread'\) with a float32 scalar.*\({why}"
            r".*Pass per-example values.*fleet.all_reduce\(value, 'sum'\)")):
        fleet.distributed_step(step)(MLP(nnx.Rngs(0)), nnx.metrics.Average("spread"), x, y)


def test_a_positional_scalar_that_no_reduction_combines_is_named_by_position(make_world):
    def step(model, metric, x, mask):
        metric.update(model(x)[:, 1], jnp.std(model(x)[:, 0]) > 0)

    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"updates metric Masked \(the 2nd argument\)"
                       r" with a bool scalar"):
        fleet.distributed_step(step)(MLP(nnx.Rngs(0)), Masked(), np.ones((BATCH, 6), np.float32),
                                     np.ones(BATCH, bool))


# -- across processes (tests/workers/two_processes.py's "metrics" scenario) ----------

def process_metrics():
    """The metrics the two-process scenario updates: a mean, a float sum (summed over
    the processes' replicas), a per-example Welford (gathered in global order)."""
    return nnx.MultiMetric(loss=nnx.metrics.Average("loss"), summed=nnx.metrics.Average("summed"),
                           err=nnx.metrics.Welford("err"))


def process_metrics_step(model, optimizer, metrics, x, y):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    optimizer.update(model, grads)
    err = (model(x) - y)[:, 0]
    metrics.update(loss=loss, summed=(err ** 2).sum(), err=err)
    return loss

