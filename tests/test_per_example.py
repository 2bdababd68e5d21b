"""Per-example gradients (``jax.vmap`` / ``nnx.vmap`` of a gradient over the batch
rows), as Optax's DP-SGD (``optax.contrib.dpsgd``) and per-example clipping take
them.

Each replica computes its own rows' per-example gradients, and fleet reduces a
parameter's gradient over the replicas as a whole: batched, that averages
example ``i`` of every replica. Before ``fleet.semantics._per_example`` every
variant below trained silently differently from one device (4 CPU devices, 5
steps of a two-layer MLP: DP-SGD 0.033 from one device without noise, 0.12 with
it; the clip by hand 0.017). Now the first call refuses them, naming a
parameter, before anything runs. On one replica the per-example gradients are
the single-device ones, and the step equals one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from optax import contrib

import fleet
from tests import models, tiers

# (optax.contrib.dpsgd takes a seed in optax 0.2.8, and warns of it in newer ones)
pytestmark = pytest.mark.filterwarnings("ignore:\"seed\" is deprecated:DeprecationWarning")


def per_example_loss(model, x, y):
    return jnp.mean((model(x[None]) - y[None]) ** 2)


def dpsgd_step(model, optimizer, x, y):
    """Optax's DP-SGD as an NNX step: the optimizer takes per-example gradients."""
    grads = nnx.vmap(nnx.grad(per_example_loss), in_axes=(None, 0, 0))(model, x, y)
    optimizer.update(model, grads)


def clipped_step(model, optimizer, x, y):
    """Per-example clipping by hand, then the mean of the clipped gradients."""
    grads = nnx.vmap(nnx.grad(per_example_loss), in_axes=(None, 0, 0))(model, x, y)
    leaves = jax.tree.leaves(grads)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in leaves))
    scale = jnp.minimum(1.0, 0.5 / (norms + 1e-6))
    optimizer.update(model, jax.tree.map(
        lambda g: jnp.mean(g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), axis=0), grads))


def dpsgd(noise: float = 1.0) -> optax.GradientTransformation:
    return contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=noise, seed=1)


def strategy(stage: int) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if stage:
        s.sharding, s.sharding_configs = True, {"stage": stage}
    return s


def params(model) -> list:
    return list(models.flat_params(model).values())


def test_dpsgd_on_one_replica_equals_one_device(make_world):
    data = models.batches("linear", 3, 8)
    ref = models.LinearNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, dpsgd(), wrt=nnx.Param)
    one_device = nnx.jit(dpsgd_step)
    for x, y in data:
        one_device(ref, ref_opt, x, y)
    make_world(1)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, dpsgd(), wrt=nnx.Param))
    step = fleet.distributed_step(dpsgd_step)
    for x, y in data:
        step(model, optimizer, x, y)
    for got, want in zip(params(model), params(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def sgd() -> optax.GradientTransformation:
    return optax.sgd(0.1)


# name: (step, the optimizer's transformation, wrap the model, wrap the optimizer)
NNX_VARIANTS = {
    "dpsgd, both wrapped": (dpsgd_step, dpsgd, True, True),
    "dpsgd, plain optimizer": (dpsgd_step, dpsgd, True, False),
    "dpsgd, raw model": (dpsgd_step, dpsgd, False, True),
    "clipped by hand": (clipped_step, sgd, True, True),
}


@pytest.mark.parametrize("name", NNX_VARIANTS)
def test_per_example_gradients_are_refused_before_anything_runs(make_world, name):
    fn, tx, wrap_model, wrap_optimizer = NNX_VARIANTS[name]
    make_world(4)
    model = models.LinearNet(nnx.Rngs(0))
    before = params(model)
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    if wrap_model:
        model = fleet.distributed_model(model)
    if wrap_optimizer:
        optimizer = fleet.distributed_optimizer(optimizer)
    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=(
            r"gradients per example .*the gradient of the 1st argument .*variable "
            r"'_linear[12]\.(kernel|bias)' \(shape \(\d+(, \d+)?,?\)\) came back with shape "
            r"\(4, .*this replica's 4 rows.*differentiate the loss over the whole batch")):
        fleet.distributed_step(fn)(model, optimizer, x, y)
    for got, want in zip(params(model), before):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=tiers.slow),
                                   pytest.param(2, marks=tiers.slow), 3])
def test_per_example_gradients_are_refused_under_sharding(make_world, stage):
    make_world(4, strategy(stage))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, sgd(), wrt=nnx.Param))
    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=r"gradients per example .*this replica's 4 rows"):
        fleet.distributed_step(clipped_step)(model, optimizer, x, y)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))


def test_per_example_gradients_of_a_linen_apply_are_refused(make_world):
    """Optax's DP-SGD written functionally: ``jax.vmap(jax.grad(loss))`` over
    the wrapped module's ``apply``, a distributed optax transformation."""
    make_world(4)
    net = fleet.distributed_model(LinenMLP())
    x, y = models.batches("linear", 1, 16)[0]
    variables = net.init(jax.random.key(0), x)
    tx = fleet.distributed_optimizer(dpsgd())

    def loss(p, x, y):
        return jnp.mean((net.apply({"params": p}, x[None]) - y[None]) ** 2)

    def step(p, opt_state, x, y):
        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x, y)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    with pytest.raises(fleet.FleetError, match=r"gradients per example .*the 1st argument "
                                               r"leaf 'Dense_[01]\.(kernel|bias)'"):
        fleet.distributed_step(step)(variables["params"], tx.init(variables["params"]), x, y)


@pytest.mark.parametrize("stage, rows", [(0, 10), (2, 4), (3, 4)])
def test_rows_as_many_as_a_parameter_axis_are_not_per_example(make_world, stage, rows):
    """The check's near misses: a replica's rows equal to a kernel's axis (10), or
    to ZeRO's degree (4, its reduce-scatter's rows), in an ordinary step, which
    trains as on one device."""
    data = models.batches("linear", 2, 4 * rows)

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    ref = models.LinearNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, sgd(), wrt=nnx.Param)
    want = [float(nnx.jit(step)(ref, ref_opt, x, y)) for x, y in data]
    make_world(4, strategy(stage))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, sgd(), wrt=nnx.Param))
    got = [float(fleet.distributed_step(step)(model, optimizer, x, y)) for x, y in data]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(params(model), params(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def microbatch_dpsgd_step(model, optimizer, x, y):
    """DP-SGD over microbatches of two rows (TF-Privacy's num_microbatches): a
    gradient per group of ``x.reshape(-1, 2, ...)``."""
    xs, ys = x.reshape(-1, 2, x.shape[1]), y.reshape(-1, 2, y.shape[1])
    grads = nnx.vmap(nnx.grad(lambda m, xb, yb: jnp.mean((m(xb) - yb) ** 2)),
                     in_axes=(None, 0, 0))(model, xs, ys)
    optimizer.update(model, grads)


def test_gradients_per_microbatch_are_refused(make_world):
    """A gradient per group of rows is batched over the replica's groups (here 2 of
    its 4 rows' pairs, where one device has 8): 0.038 from one device after 4
    steps before the groups were counted as rows."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, dpsgd(0.0), wrt=nnx.Param))
    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=r"takes gradients per example .*rows in 2 "
                                               r"groups \(x.reshape\(-1, k, ...\)"):
        fleet.distributed_step(microbatch_dpsgd_step)(model, optimizer, x, y)


def looped_dpsgd_step(model, optimizer, x, y):
    """DP-SGD with the per-example gradients taken in a loop over the rows
    (``jax.lax.map``), of the raw parameters split from the model."""
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.lax.map(lambda xy: jax.grad(lambda p: per_example_loss(
        nnx.merge(graphdef, p, rest), *xy))(state), (x, y))
    optimizer.update(model, grads)


def looped_forward_step(model, optimizer, x, y):
    """The loss looped over the rows, differentiated outside the loop: the loop's
    transpose accumulates each parameter's gradient in its carry."""
    def loss_fn(m):
        return jax.lax.map(lambda xy: per_example_loss(m, *xy), (x, y)).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_per_example_gradients_in_a_loop_over_the_rows_are_refused(make_world):
    """``jax.lax.map`` reduces each row's gradient over the replicas inside the loop
    (example i of every replica averaged): DP-SGD so ended 0.019 from one device in
    the parameters after 3 steps before. The loss looped over the rows and
    differentiated outside the loop equals one device."""
    data = models.batches("linear", 3, 16)
    ref = models.LinearNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, sgd(), wrt=nnx.Param)
    want = [float(nnx.jit(looped_forward_step)(ref, ref_opt, x, y)) for x, y in data]
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, dpsgd(0.0), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=r"gradients per example in a loop over the "
                                               r"batch rows \(jax.lax.map .*4 on this replica"):
        fleet.distributed_step(looped_dpsgd_step)(model, optimizer, *data[0])
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, sgd(), wrt=nnx.Param))
    step = fleet.distributed_step(looped_forward_step)
    got = [float(step(model, optimizer, x, y)) for x, y in data]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert models.max_diff(models.flat_params(model), models.flat_params(ref)) < 1e-6
