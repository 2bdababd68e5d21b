"""Values handed to the optimizer's update: optax's ``value=`` (reduce_on_plateau,
polyak_sgd, the line searches) and ``value_fn=`` (L-BFGS).

Inside a step each replica computes its loss on its own rows. Handed on as
``optimizer.update(model, grads, value=loss)``, each replica's optimizer would step
on its own loss, where one device steps on the global batch's: the scripts were
refused for the wrong reason (reduce_on_plateau: JAX's typing of a ``cond`` deep in
optax; polyak_sgd: "compute its gradient through a wrapped model", which it did;
L-BFGS: a ``while_loop`` carry the user never wrote). They are now refused naming
the argument and the fix, ``value=fleet.all_reduce(loss, 'avg')``, with which they
equal one device (``fleet.all_reduce`` is the identity there, so the script stays one
script).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers

PER_REPLICA = r"given value= a value that differs across replicas.*value=fleet\.all_reduce\(loss, 'avg'\)"


def mse(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def plateau():
    """optax's reduce_on_plateau after SGD, quick to cut the rate (patience 0)."""
    return optax.chain(optax.sgd(0.05), optax.contrib.reduce_on_plateau(
        patience=0, cooldown=0, factor=0.5, rtol=0.5, accumulation_size=1))


OPTIMIZERS = {"reduce_on_plateau": plateau,
              "polyak_sgd": lambda: optax.polyak_sgd(max_learning_rate=0.1)}


def step_with(value_of):
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(mse)(model, x, y)
        optimizer.update(model, grads, value=value_of(loss))
        return loss
    return step


def per_replica(loss):  # what the optax pages write
    return loss


def global_value(loss):  # what the refusal says to write
    return fleet.all_reduce(loss, "avg")


def run(tx, step, data, distributed: bool):
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    if distributed:
        model = fleet.distributed_model(model)
        optimizer = fleet.distributed_optimizer(optimizer)
        fn = fleet.distributed_step(step)
    else:
        fn = nnx.jit(step)
    losses = [float(fn(model, optimizer, x, y)) for x, y in data]
    if distributed:  # (replicated state holds the same bits on every device)
        assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    return losses, models.flat_params(model), models.flat_params(nnx.state(optimizer))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_per_replica_value_is_refused_naming_it(make_world, name):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, OPTIMIZERS[name](),
                                                          wrt=nnx.Param))
    before = models.flat_params(model)
    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=PER_REPLICA):
        fleet.distributed_step(step_with(per_replica))(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), before) == 0.0  # nothing stepped


@pytest.mark.parametrize("n", tiers.devices(1, 4))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_global_value_equals_one_device(make_world, n, name):
    data = [(x * (1 + k % 3), y) for k, (x, y) in enumerate(models.batches("linear", 6, 16))]
    ref = run(OPTIMIZERS[name], step_with(global_value), data, distributed=False)
    make_world(n)
    got = run(OPTIMIZERS[name], step_with(global_value), data, distributed=True)
    d_params, d_state = models.max_diff(ref[1], got[1]), models.max_diff(ref[2], got[2])
    print(f"{name} on {n}: |dparams| {d_params:.1e}, |dstate| {d_state:.1e}, "
          f"losses {ref[0]} vs {got[0]}")
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert d_params < 1e-5 and d_state < 1e-5
    if name == "reduce_on_plateau":  # the value moved the schedule: the test can tell
        scale = [v for k, v in ref[2].items() if "scale" in k]
        assert scale and float(scale[0]) < 1.0, ref[2].keys()


def test_the_functional_form_is_refused_alike(make_world):
    """optax on raw parameters, ``fleet.distributed_optimizer(optax.polyak_sgd())``:
    the same refusal from the transformation's update."""
    make_world(4)
    params = nnx.state(models.LinearNet(nnx.Rngs(0)), nnx.Param)
    apply = nnx.graphdef(models.LinearNet(nnx.Rngs(0)))
    tx = fleet.distributed_optimizer(optax.polyak_sgd(max_learning_rate=0.1))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: mse(nnx.merge(apply, p), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state, loss

    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=PER_REPLICA):
        fleet.distributed_step(step)(params, tx.init(params), x, y)


def test_a_per_replica_value_fn_is_refused_naming_it(make_world):
    """The cookbook's L-BFGS with its value made global but its line search's
    ``value_fn`` still closing over the replica's rows."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.lbfgs(1e-3),
                                                          wrt=nnx.Param))

    def step(model, optimizer, x, y):
        graphdef = nnx.graphdef(model)
        loss, grads = nnx.value_and_grad(mse)(model, x, y)
        optimizer.update(model, grads, grad=grads, value=fleet.all_reduce(loss, "avg"),
                         value_fn=lambda state: mse(nnx.merge(graphdef, state), x, y))
        return loss

    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=r"given value_fn= a function whose value "
                       r"differs across replicas.*value_fn=lambda p: fleet\.all_reduce"):
        fleet.distributed_step(step)(model, optimizer, x, y)


@pytest.mark.parametrize("global_obj_fn", [False, True])
def test_sophias_obj_fn_is_refused_naming_it(make_world, global_obj_fn):
    """optax.contrib.sophia's Hessian estimate differentiates its ``obj_fn=`` forward-mode
    (``jax.jvp`` of its gradient), which fleet's gradient syncs and ``fleet.all_reduce``
    (custom_vjp functions) do not allow: refused naming it, where JAX's raw TypeError
    came out before, and where an obj_fn on raw parameters would have estimated each
    replica's Hessian. The same step runs on one device."""
    def step(model, optimizer, x, y):
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        def obj_fn(params):
            loss = mse(nnx.merge(graphdef, params, rest), x, y)
            return fleet.all_reduce(loss, "avg") if global_obj_fn else loss

        loss, grads = nnx.value_and_grad(mse)(model, x, y)
        optimizer.update(model, grads, obj_fn=obj_fn)
        return loss

    x, y = models.batches("linear", 1, 16)[0]
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.contrib.sophia(1e-2), wrt=nnx.Param)
    assert jnp.isfinite(nnx.jit(step)(model, optimizer, x, y))  # one device: runs
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.contrib.sophia(1e-2),
                                                          wrt=nnx.Param))
    before = models.flat_params(model)
    with pytest.raises(fleet.FleetError, match=r"given obj_fn=.*differentiates forward-mode"
                       r".*optax\.contrib\.sophia.*use an optimizer that needs the gradients"):
        fleet.distributed_step(step)(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), before) == 0.0  # nothing stepped


def test_sophias_obj_fn_on_raw_parameters_is_refused(make_world):
    """The functional form, ``fleet.distributed_optimizer(optax.contrib.sophia(...))`` on
    raw parameters: no custom_vjp stood in JAX's way, and before the refusal the step
    ran silently apart from one device (each replica estimated the Hessian of its own
    rows: 0.012 in parameters of 0.57 after 6 steps, ``gamma=100``)."""
    graphdef, params = nnx.split(models.LinearNet(nnx.Rngs(0)), nnx.Param)
    tx = fleet.distributed_optimizer(optax.contrib.sophia(1e-2, update_interval=1,
                                                          gamma=100.0))

    def step(params, opt_state, x, y):
        def loss_of(p):
            return mse(nnx.merge(graphdef, p), x, y)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params, obj_fn=loss_of)
        return optax.apply_updates(params, updates), opt_state, loss

    make_world(4)
    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=r"given obj_fn=.*optax\.contrib\.sophia"):
        fleet.distributed_step(step)(params, tx.init(params), x, y)
