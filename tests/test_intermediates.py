"""Intermediates a module stores with ``Module.sow`` (an auxiliary loss, activations).

Popped inside the step, as the loss reads them (``nnx.pop(model, nnx.Intermediate)``),
the step trains as on one device. Left in the model, they change its structure,
which a fleet step keeps: refused, naming the intermediate and ``nnx.pop`` (it was
refused as "the step changed the structure of an NNX object ... build the whole
model before training", which the script had done).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fleet
from tests import models


class Sowing(nnx.Module):
    """A hidden layer whose mean squared activation is sown, for a penalty."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(10, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.hidden(x))
        with warnings.catch_warnings():  # (flax 0.12.8 asks for nnx.capture; still supported)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.sow(nnx.Intermediate, "activation", jnp.mean(h ** 2))
        return self.out(h)


def popped(model, optimizer, x, y):
    def loss_fn(m):
        pred = m(x)
        sown = nnx.pop(m, nnx.Intermediate)
        penalty = sum(jnp.sum(v) for v in jax.tree.leaves(sown))
        return jnp.mean((pred - y) ** 2) + 0.01 * penalty

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def left_in(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def test_intermediates_popped_in_the_step_train_as_on_one_device(make_world):
    data = models.batches("linear", 3, 16)
    ref = Sowing(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    single = nnx.jit(popped)
    want = [float(single(ref, ref_opt, x, y)) for x, y in data]
    make_world(4)
    model = fleet.distributed_model(Sowing(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(popped)
    got = [float(step(model, optimizer, x, y)) for x, y in data]
    d = models.max_diff(models.flat_params(model), models.flat_params(ref))
    print(f"sown penalty, popped: |dparams| {d:.1e}")
    assert got == pytest.approx(want, rel=1e-5) and d < 1e-5
    assert fleet.check_replicas(model) == []


def test_intermediates_left_in_the_model_are_refused_naming_them(make_world):
    make_world(4)
    model = fleet.distributed_model(Sowing(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    x, y = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=r"stored intermediates in the model "
                       r"\(Module.sow: .*activation\).*nnx.pop\(model, nnx.Intermediate\)"):
        fleet.distributed_step(left_in)(model, optimizer, x, y)


def test_another_change_of_structure_is_refused_as_such(make_world):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))

    def grows(model, x):
        model.extra = nnx.Param(jnp.zeros(()))  # a variable added inside the step
        return jnp.mean(model(x))

    x, _ = models.batches("linear", 1, 16)[0]
    with pytest.raises(fleet.FleetError, match=r"changed the structure of an NNX object"):
        fleet.distributed_step(grows)(model, x)
