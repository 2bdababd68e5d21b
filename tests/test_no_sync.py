"""Acceptance: k steps inside ``no_sync`` plus one normal step equal one
single-card step on the union batch, and no psum is traced inside ``no_sync``."""

import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models
from tests.jaxpr_utils import count_primitives


def union_reference(data, tx):
    x = np.concatenate([x for x, _ in data])
    y = np.concatenate([y for _, y in data])
    return models.nnx_reference("linear", [(x, y)], tx=tx)[1]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("tx_name", ["sgd", "adam"])
def test_no_sync_steps_then_one_step_equal_the_union_step(make_world, k, tx_name):
    tx = {"sgd": optax.sgd(0.5), "adam": optax.adam(models.LR)}[tx_name]
    data = models.batches("linear", k + 1, 8)
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    before = models.flat_params(model)
    for x, y in data[:k]:
        with model.no_sync():
            step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), before) == 0  # nothing stepped yet
    assert int(optimizer.step.get_value()) == 0
    step(model, optimizer, *data[k])
    assert models.max_diff(models.flat_params(model), union_reference(data, tx)) < 1e-5
    assert int(optimizer.step.get_value()) == 1

    # The accumulator is consumed: the next normal step is an ordinary step.
    x, y = data[0]
    ref = models.NNX_MODELS["linear"](nnx.Rngs(0))
    nnx.update(ref, nnx.state(model))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    nnx.update(ref_opt, nnx.state(optimizer))
    nnx.jit(models.nnx_train_step)(ref, ref_opt, x, y)
    step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), models.flat_params(ref)) < 1e-5


def test_no_psum_is_traced_inside_no_sync(make_world):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    x, y = models.batches("linear", 1, 8)[0]
    assert count_primitives(step.make_jaxpr(model, optimizer, x, y)) == 1  # one 1-MB bucket
    with model.no_sync():
        assert count_primitives(step.make_jaxpr(model, optimizer, x, y)) == 0
        step(model, optimizer, x, y)
        assert count_primitives(step.make_jaxpr(model, optimizer, x, y)) == 0


def test_no_sync_with_an_optax_train_state(make_world):
    """The optax path (Linen + TrainState) accumulates the same way."""
    import jax
    from flax.training.train_state import TrainState

    data = models.batches("linear", 3, 8)
    x_all = np.concatenate([x for x, _ in data])
    y_all = np.concatenate([y for _, y in data])
    _, ref_params = models.linen_reference("linear", [(x_all, y_all)])

    make_world(2)
    model = fleet.distributed_model(models.LinenLinearNet())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=fleet.distributed_optimizer(optax.adam(models.LR)))
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data[:2]:
        with model.no_sync():
            state, _ = step(state, x, y)
    state, _ = step(state, *data[2])
    assert models.max_diff(models.flat_params(state.params), ref_params) < 1e-5


def test_no_sync_cannot_be_entered_inside_a_step(make_world):
    make_world(2)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))

    @fleet.distributed_step
    def step(model, x):
        with model.no_sync():
            return model(x).mean()

    with pytest.raises(fleet.FleetError, match="enter it around the call"):
        step(model, np.ones((4, 10), np.float32))
