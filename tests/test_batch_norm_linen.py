"""A wrapped Linen module's ``nn.BatchNorm`` in a step (issue 21, acceptance 2).

fleet cannot set a Linen layer's fields, so the choice is read at each call:
``nn.BatchNorm(axis_name=fleet.DATA_AXIS)`` in the model, or
``strategy.sync_batch_norm = True``, equals the single-device step (loss,
parameters, running statistics); ``strategy.sync_batch_norm = False`` equals
per-replica statistics computed by hand; no choice, or an axis kept from a
``jax.pmap`` script (``axis_name="batch"``), raises with what to write.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import linen
from flax.training.train_state import TrainState

import fleet
from tests import tiers
from tests.test_batch_norm import LR, data


class LinenNet(linen.Module):
    axis_name: str | None = None

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(8)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.9,
                            axis_name=self.axis_name)(x)
        return linen.Dense(1)(linen.relu(x))


class LinenState(TrainState):
    batch_stats: dict


def loss_of(apply_fn, params, batch_stats, x, y):
    out, updates = apply_fn({"params": params, "batch_stats": batch_stats}, x,
                            mutable=["batch_stats"])
    return ((out - y) ** 2).mean(), updates


def train_step(state, x, y):
    (value, updates), grads = jax.value_and_grad(
        lambda p: loss_of(state.apply_fn, p, state.batch_stats, x, y), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), value


def start(module, apply_fn=None) -> LinenState:
    variables = module.init(jax.random.key(0), data()[0][0])
    return LinenState.create(apply_fn=apply_fn or module.apply, params=variables["params"],
                             batch_stats=variables["batch_stats"], tx=optax.sgd(LR))


def state_of(state: LinenState) -> dict:
    flat = jax.tree_util.tree_flatten_with_path((state.params, state.batch_stats))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def one_device() -> tuple[list, dict]:
    state, step, losses = start(LinenNet()), jax.jit(train_step), []
    for x, y in data():
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return losses, state_of(state)


def per_replica(n: int) -> tuple[list, dict]:
    """Each of ``n`` replicas normalises with its own rows; the losses, the gradients
    and the running statistics the replicas leave are averaged."""
    module = LinenNet()
    state, losses = start(module), []
    grad = jax.jit(jax.value_and_grad(
        lambda p, s, x, y: loss_of(module.apply, p, s, x, y), has_aux=True))
    for x, y in data():
        rows = len(x) // n
        parts = [grad(state.params, state.batch_stats, x[r * rows:(r + 1) * rows],
                      y[r * rows:(r + 1) * rows]) for r in range(n)]
        mean = lambda *t: sum(t) / n  # noqa: E731
        grads = jax.tree.map(mean, *[g for _, g in parts])
        stats = jax.tree.map(mean, *[u["batch_stats"] for (_, u), _ in parts])
        state = state.apply_gradients(grads=grads, batch_stats=stats)
        losses.append(float(sum(loss for (loss, _), _ in parts) / n))
    return losses, state_of(state)


def fleet_run(make_world, devices: int, axis_name, choice) -> tuple[list, dict]:
    make_world(devices, fleet.DistributedStrategy(sync_batch_norm=choice))
    state = start(fleet.distributed_model(LinenNet(axis_name=axis_name)))
    step, losses = fleet.distributed_step(train_step), []
    for x, y in data():
        state, loss = step(state, x, y)
        losses.append(float(loss))
    assert fleet.check_replicas((state.params, state.batch_stats)) == []
    return losses, state_of(state)


def distance(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


CASES = {  # (axis_name written in the layer, strategy.sync_batch_norm): the reference
    "axis_name=fleet.DATA_AXIS": (fleet.DATA_AXIS, None, "one device"),
    "sync_batch_norm=True": (None, True, "one device"),
    "sync_batch_norm=False": (None, False, "per replica"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("devices", tiers.devices(1, 2, 4, 8))
def test_linen_batch_norm_equals_its_reference(make_world, devices, case):
    axis_name, choice, reference = CASES[case]
    want_losses, want = one_device() if reference == "one device" else per_replica(devices)
    losses, got = fleet_run(make_world, devices, axis_name, choice)
    d_loss = float(np.max(np.abs(np.array(losses) - want_losses)))
    d_state = distance(got, want)
    print(f"Linen {case}, {devices} devices, against {reference}: |loss| = {d_loss:.1e}, "
          f"|parameters and running statistics| = {d_state:.1e}")
    assert d_loss <= 1e-5 and d_state <= 1e-5
    assert "[1]['BatchNorm_0']['mean']" in got  # the running statistics are compared


def test_linen_layer_axis_name_wins_over_per_replica_choice(make_world):
    """The layer's own ``axis_name=fleet.DATA_AXIS`` is the nearer choice."""
    want_losses, want = one_device()
    losses, got = fleet_run(make_world, 4, fleet.DATA_AXIS, False)
    assert distance(got, want) <= 1e-5


@pytest.mark.parametrize("devices", tiers.devices(1, 4))
def test_linen_batch_norm_not_chosen_says_what_to_write(make_world, devices):
    """No choice: the layer is named with both choices, and the old suggestion
    (out_reduce='mean' on batch_stats, which silently changes the model) is gone."""
    with pytest.raises(fleet.FleetError, match=r"the Linen BatchNorm 'BatchNorm_0' runs in "
                                               r"training mode") as info:
        fleet_run(make_world, devices, None, None)
    message = str(info.value)
    assert "nn.BatchNorm(..., axis_name=fleet.DATA_AXIS)  # statistics over the global" in message
    assert "strategy.sync_batch_norm = False  # DDP's per-replica statistics" in message
    assert "out_reduce" not in message


def test_linen_batch_norm_axis_kept_from_pmap_is_named(make_world):
    with pytest.raises(fleet.FleetError, match=r"'BatchNorm_0' has axis_name='batch', which is "
                                               r"not an axis of fleet's step.*axis_name="
                                               r"fleet\.DATA_AXIS \('data'\)"):
        fleet_run(make_world, 4, "batch", True)


def test_linen_batch_norm_in_evaluation_and_outside_a_step_runs_as_one_device(make_world):
    """Evaluation mode in a step, and training mode outside one (``axis_name`` on the
    data axis then means the rows given: the whole batch), run as Flax on one device."""
    make_world(4)
    module = fleet.distributed_model(LinenNet(axis_name=fleet.DATA_AXIS))
    x, _ = data()[0]
    variables = module.init(jax.random.key(0), x)
    reference = LinenNet().apply(variables, x, train=False)
    got = fleet.distributed_step(lambda v, x: module.apply(v, x, train=False))(variables, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-6)
    want, want_stats = LinenNet().apply(variables, x, mutable=["batch_stats"])
    got, got_stats = module.apply(variables, x, mutable=["batch_stats"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
                 got_stats, want_stats)
