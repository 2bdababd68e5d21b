"""Acceptance: N devices with global batch B train the same model as one device
with batch B -- per-step losses and final parameters within 1e-5.

The fleet side is the single-card script converted in four steps: init,
distributed_model, distributed_optimizer, distributed_step (for nnx.jit/jax.jit).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from tests import models, tiers

STEPS, BATCH, TOL = 30, 16, 1e-5
DEVICES = tiers.devices(1, 2, 4, 8, core=True)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(api, kind):
        if (api, kind) not in cache:
            data = models.batches(kind, STEPS, BATCH)
            ref = models.nnx_reference if api == "nnx" else models.linen_reference
            cache[api, kind] = (data, *ref(kind, data))
        return cache[api, kind]

    return get


def train_nnx_fleet(kind, data, wrap_model_first=False):
    model = models.NNX_MODELS[kind](nnx.Rngs(0))
    if wrap_model_first:  # seeds 002: wrap the model, build the optimizer on it
        model = fleet.distributed_model(model)
        optimizer = nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param)
    else:  # seeds 004: optimizer on the inner model, then wrap both
        optimizer = nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param)
        model = fleet.distributed_model(model)
    optimizer = fleet.distributed_optimizer(optimizer)
    step = fleet.distributed_step(models.nnx_train_step)
    losses = [float(step(model, optimizer, x, y)) for x, y in data]
    return losses, models.flat_params(model), step


def train_linen_fleet(kind, data):
    model = fleet.distributed_model(models.LINEN_MODELS[kind]())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(
        apply_fn=model.apply, params=params, tx=fleet.distributed_optimizer(optax.adam(models.LR))
    )
    step = fleet.distributed_step(models.linen_train_step)
    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return losses, models.flat_params(state.params), step


@pytest.mark.parametrize("kind", ["linear", "cnn"])
@pytest.mark.parametrize("n", DEVICES)
def test_nnx_matches_single_card(make_world, references, kind, n):
    data, ref_losses, ref_params = references("nnx", kind)
    make_world(n)
    losses, params, step = train_nnx_fleet(kind, data)
    assert np.abs(np.array(losses) - ref_losses).max() < TOL
    assert models.max_diff(params, ref_params) < TOL
    assert step.trace_count == 1  # compiled once for 30 calls of one shape


@pytest.mark.parametrize("kind", ["linear", "cnn"])
@pytest.mark.parametrize("n", DEVICES)
def test_linen_matches_single_card(make_world, references, kind, n):
    data, ref_losses, ref_params = references("linen", kind)
    make_world(n)
    losses, params, _ = train_linen_fleet(kind, data)
    assert np.abs(np.array(losses) - ref_losses).max() < TOL
    assert models.max_diff(params, ref_params) < TOL


@pytest.mark.parametrize("n", tiers.devices(1, 4, core=True))
def test_optimizer_built_on_wrapped_model(make_world, references, n):
    data, ref_losses, ref_params = references("nnx", "linear")
    make_world(n)
    losses, params, _ = train_nnx_fleet("linear", data, wrap_model_first=True)
    assert np.abs(np.array(losses) - ref_losses).max() < TOL
    assert models.max_diff(params, ref_params) < TOL


def test_updates_are_not_scaled_by_replica_count(make_world):
    """A guard against the double reduction (shard_map's transpose + fleet's psum):
    one SGD step on 8 devices moves the parameters exactly as on one device."""
    data = models.batches("linear", 1, BATCH)
    _, ref_params = models.nnx_reference("linear", data, tx=optax.sgd(1.0))
    make_world(8)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param))
    fleet.distributed_step(models.nnx_train_step)(model, optimizer, *data[0])
    assert models.max_diff(models.flat_params(model), ref_params) < TOL
