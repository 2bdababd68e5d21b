"""Optimizers whose state holds optax's ``MaskedNode``: Muon (``optax.contrib.muon``).

Muon orthogonalises the updates of the 2-D parameters and hands the others to Adam,
through optax's masking: each part's state keeps a ``MaskedNode`` (no array) where
the parameter belongs to the other part, and ``nnx.Optimizer`` wraps those in
variables too. fleet counted every variable as one array: the step failed on its
first call as "the step fails as a single-device step on the global batch ... Too
many leaves for PyTreeDef" (a refusal for a reason the script did not write), and a
checkpoint failed with "Cannot determine dtype of MaskedNode()". A variable of no
array is now structure (``fleet.runtime._leaves.variables_of``): Muon trains as on
one device, with check_nan_inf and gradient merge, and its checkpoint restores.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(10, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def muon():
    return optax.contrib.muon(1e-2)


def train(model, optimizer, step, data) -> None:
    for x, y in data:
        step(model, optimizer, x, y)


def flat_state(optimizer) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(optimizer))[0]}


def one_device(data, tx=muon):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    train(model, optimizer, nnx.jit(models.nnx_train_step), data)
    return model, optimizer


def with_fleet(data, make_world, n, strategy=None):
    make_world(n, strategy)
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, muon(), wrt=nnx.Param))
    train(model, optimizer, fleet.distributed_step(models.nnx_train_step), data)
    assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    return model, optimizer


def compare(ref, got, where: str) -> None:
    d_params = models.max_diff(models.flat_params(ref[0]), models.flat_params(got[0]))
    d_state = models.max_diff(flat_state(ref[1]), flat_state(got[1]))
    print(f"muon, {where}: |dparams| {d_params:.1e}, |dstate| {d_state:.1e}")
    assert d_params < 1e-5 and d_state < 1e-5


def test_the_state_holds_masked_nodes():
    """(What the other tests stand on: Muon's state has variables of no array.)"""
    optimizer = nnx.Optimizer(MLP(nnx.Rngs(0)), muon(), wrt=nnx.Param)
    leaves = jax.tree.leaves(nnx.state(optimizer), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert any(not jax.tree.leaves(v) for v in leaves)


@pytest.mark.parametrize("n", tiers.devices(1, 4))
def test_muon_equals_one_device(make_world, n):
    data = models.batches("linear", 4, 16)
    compare(one_device(data), with_fleet(data, make_world, n), f"{n} devices")


@pytest.mark.parametrize("section", ["check_nan_inf", "gradient_merge"])
def test_muon_with_a_section_equals_one_device(make_world, section):
    strategy = fleet.DistributedStrategy()
    setattr(strategy, section, True)
    tx = muon
    if section == "gradient_merge":
        strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
        tx = lambda: optax.MultiSteps(muon(), 2)  # noqa: E731 (the merged single-device step)
    data = models.batches("linear", 4, 16)
    ref = one_device(data, tx)
    got = with_fleet(data, make_world, 4, strategy)
    d = models.max_diff(models.flat_params(ref[0]), models.flat_params(got[0]))
    print(f"muon with {section}: |dparams| {d:.1e}")
    assert d < 1e-5


def test_a_muon_checkpoint_restores_and_training_goes_on_alike(make_world, tmp_path):
    data = models.batches("linear", 6, 16)
    ref = one_device(data)
    make_world(4)
    step = fleet.distributed_step(models.nnx_train_step)
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, muon(), wrt=nnx.Param))
    train(model, optimizer, step, data[:3])
    manager = fleet.CheckpointManager(tmp_path / "ckpt")
    manager.save(3, model=model, optimizer=optimizer)
    model = fleet.distributed_model(MLP(nnx.Rngs(1)))  # other initial values
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, muon(), wrt=nnx.Param))
    assert manager.restore_latest(model=model, optimizer=optimizer).step == 3
    manager.close()
    train(model, optimizer, step, data[3:])
    compare(ref, (model, optimizer), "saved after 3 steps, restored, 3 more")


def test_muon_under_sharding_is_refused_naming_why(make_world):
    """ZeRO splits the state by the parameters' shapes; Muon's masks are chosen by
    them (2-D or not), so a slice's state is not a slice of the state."""
    strategy = fleet.DistributedStrategy()
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 2}
    with pytest.raises(fleet.FleetError, match=r"strategy.sharding: the optimizer's state "
                       r"changes structure with the parameters' shapes.*turn strategy.sharding off"):
        with_fleet(models.batches("linear", 1, 16), make_world, 4, strategy)


def test_a_variable_holding_a_list_of_arrays_is_refused_naming_it(make_world):
    """optax.sm3 keeps a list of per-axis accumulators for each parameter, which
    nnx.Optimizer puts in one variable. The step failed as "the step fails as a
    single-device step on the global batch ... Too few leaves for PyTreeDef"
    (it runs on one device); distributed_optimizer now refuses, naming the
    variable and what to use instead."""
    x, y = models.batches("linear", 1, 16)[0]
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sm3(1e-2), wrt=nnx.Param)
    nnx.jit(models.nnx_train_step)(model, optimizer, x, y)  # (one device: it runs)
    make_world(4)
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    with pytest.raises(fleet.FleetError, match=(
            r"variable 'opt_state.0.mu.hidden.bias' holds a list of 1 array \(shape "
            r"\(16,\)\), where a fleet step keeps one array per variable: "
            r"optax.sm3's state.*optax.adafactor")):
        fleet.distributed_optimizer(nnx.Optimizer(model, optax.sm3(1e-2), wrt=nnx.Param))
