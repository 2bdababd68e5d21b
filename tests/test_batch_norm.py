"""strategy.sync_batch_norm (issue 21): a wrapped NNX model's BatchNorm in a step.

``True`` equals the single-device step (loss, parameters, running statistics);
``False`` equals per-replica statistics computed by hand (each replica
normalises with its own rows, gradients and running statistics averaged); not
set, the first call raises and names the layer and the two choices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers

STEPS, BATCH, LR = 5, 32, 0.1  # at least 4 rows per replica on 8 devices


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(6, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.linear2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.bn(self.linear1(x))))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def data():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, 6)).astype(np.float32) * 2 + 1,
             rng.standard_normal((BATCH, 1)).astype(np.float32)) for _ in range(STEPS)]


def state_of(model) -> dict:
    return {k: np.asarray(v) for k, v in models.flat_params(nnx.to_pure_dict(nnx.state(model))).items()}


def one_device() -> tuple[list, dict]:
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    step = nnx.jit(train_step)
    losses = [float(step(model, optimizer, x, y)) for x, y in data()]
    return losses, state_of(model)


def per_replica(n: int) -> tuple[list, dict]:
    """Each of ``n`` replicas normalises with its own rows; the losses and the
    gradients are averaged, and so are the running statistics the replicas leave."""
    model = Net(nnx.Rngs(0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    losses = []
    for x, y in data():
        rows = len(x) // n
        replica_losses, grads, new_stats = [], [], []
        for r in range(n):
            replica = nnx.merge(graphdef, params, stats, copy=True)  # each its own copy
            part = slice(r * rows, (r + 1) * rows)
            loss, g = nnx.value_and_grad(loss_fn)(replica, x[part], y[part])
            replica_losses.append(loss)
            grads.append(g)
            new_stats.append(nnx.state(replica, nnx.BatchStat))
        mean_grad = jax.tree.map(lambda *g: sum(g) / n, *grads)
        params = jax.tree.map(lambda p, g: p - LR * g, params, nnx.state(mean_grad, nnx.Param))
        stats = jax.tree.map(lambda *s: sum(s) / n, *new_stats)
        losses.append(float(sum(replica_losses) / n))
    return losses, state_of(nnx.merge(graphdef, params, stats))


def fleet_run(make_world, devices: int, choice) -> tuple[list, dict, object]:
    strategy = fleet.DistributedStrategy()
    if choice is not None:
        strategy.sync_batch_norm = choice
    make_world(devices, strategy)
    model = fleet.distributed_model(Net(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param))
    step = fleet.distributed_step(train_step)
    losses = [float(step(model, optimizer, x, y)) for x, y in data()]
    return losses, state_of(model), model


def distance(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("devices", tiers.devices(1, 2, 4, 8))
def test_sync_batch_norm_equals_one_device(make_world, devices):
    want_losses, want = one_device()
    losses, got, model = fleet_run(make_world, devices, True)
    d_loss = float(np.max(np.abs(np.array(losses) - want_losses)))
    d_state = distance(got, want)
    print(f"sync_batch_norm=True, {devices} devices, {STEPS} SGD steps: |loss| = {d_loss:.1e}, "
          f"|parameters and running statistics| = {d_state:.1e}")
    assert d_loss <= 1e-5 and d_state <= 1e-5
    assert "['bn']['mean']" in got and "['bn']['var']" in got  # the running statistics
    assert fleet.check_replicas(model) == []
    # evaluation outputs (running statistics) equal one device's too
    reference = Net(nnx.Rngs(0))
    nnx.update(reference, nnx.state(model))
    reference.eval()
    model.eval()
    x = data()[0][0]
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(reference(x)), atol=1e-6)


@pytest.mark.parametrize("devices", tiers.devices(1, 2, 4, 8))
def test_per_replica_batch_norm_is_chosen_explicitly(make_world, devices):
    want_losses, want = per_replica(devices)
    losses, got, model = fleet_run(make_world, devices, False)
    d_loss = float(np.max(np.abs(np.array(losses) - want_losses)))
    d_state = distance(got, want)
    print(f"sync_batch_norm=False, {devices} devices: against per-replica statistics by hand "
          f"|loss| = {d_loss:.1e}, |state| = {d_state:.1e}; against one device "
          f"|state| = {distance(got, one_device()[1]):.1e}")
    assert d_loss <= 1e-5 and d_state <= 1e-5
    assert fleet.check_replicas(model) == []


@pytest.mark.parametrize("devices", tiers.devices(1, 2, 4, 8))
def test_batch_norm_not_chosen_raises_naming_the_layer(make_world, devices):
    with pytest.raises(fleet.FleetError) as info:
        fleet_run(make_world, devices, None)
    message = str(info.value)
    print(message)
    assert "BatchNorm layer 'bn' (flax.nnx" in message
    assert "strategy.sync_batch_norm = True   # statistics over the global batch" in message
    assert "strategy.sync_batch_norm = False  # DDP's per-replica statistics" in message


def test_evaluation_and_calls_outside_a_step_run_as_flax(make_world):
    """Not chosen: evaluation mode in a step runs; a synced layer still works
    outside a step (training mode there normalises the rows it gets) and keeps
    its class's identity for isinstance."""
    make_world(4)
    model = fleet.distributed_model(Net(nnx.Rngs(0)))
    model.eval()
    x, y = data()[0]
    fleet.distributed_step(loss_fn)(model, x, y)
    assert type(model.bn).__name__ == "CheckedBatchNorm" and isinstance(model.bn, nnx.BatchNorm)

    make_world(4, fleet.DistributedStrategy(sync_batch_norm=True))
    model = fleet.distributed_model(Net(nnx.Rngs(0)))
    reference = Net(nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(reference(x)), atol=1e-6)
    assert type(model.bn).__name__ == "SyncBatchNorm" and isinstance(model.bn, nnx.BatchNorm)


def test_the_choice_is_a_bool():
    with pytest.raises(fleet.FleetTypeError, match=r"sync_batch_norm must be of type bool \| None"):
        fleet.DistributedStrategy(sync_batch_norm="yes")


@tiers.slow  # a real fleetrun job
def test_sync_batch_norm_across_two_processes_equals_one_device(tmp_path):
    """2 processes x 2 devices through fleetrun, gloo all-reduces: the global-batch
    statistics span the processes, and the run equals one device's."""
    from pathlib import Path

    from tests import jobs
    from tests.workers import batch_norm_train

    out = tmp_path / "run.npz"
    jobs.two_processes(tmp_path, Path(batch_norm_train.__file__), str(out))
    want_losses, want = one_device()
    got = dict(np.load(out))
    losses = got.pop("losses")
    d_loss = float(np.max(np.abs(losses - want_losses)))
    d_state = distance(got, want)
    print(f"sync_batch_norm=True, 2 processes x 2 devices: |loss| = {d_loss:.1e}, "
          f"|state| = {d_state:.1e}")
    assert d_loss <= 1e-5 and d_state <= 1e-5


class Backbone(nnx.Module):
    """A pretrained feature extractor, frozen: the step trains only the head."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear, self.bn = nnx.Linear(3, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.linear(x)))


def transfer_step(head, optimizer, backbone, x, y):
    features = jax.lax.stop_gradient(backbone(x))

    def loss_fn(h):
        return optax.softmax_cross_entropy_with_integer_labels(h(features), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(head)
    optimizer.update(head, grads)
    return loss


@pytest.mark.parametrize("fix", ["backbone.eval()", "the backbone wrapped too"])
def test_an_unwrapped_backbone_in_training_mode_is_named_and_both_fixes_train_as_one_device(
        make_world, fix):
    """Transfer learning with the frozen backbone a separate argument: its
    BatchNorm in training mode normalised with the replica's rows, and the refusal
    said only "the step combines different rows". It now names the layer, the
    argument and the two fixes, each of which equals one device."""
    rs = np.random.RandomState(0)
    batches = [(rs.randn(16, 3).astype(np.float32), rs.randint(0, 2, 16).astype(np.int32))
               for _ in range(3)]

    def make(eval_mode: bool):
        head = nnx.Linear(8, 2, rngs=nnx.Rngs(1))
        backbone = Backbone(nnx.Rngs(0))
        if eval_mode:
            backbone.eval()
        return head, nnx.Optimizer(head, optax.sgd(0.1), wrt=nnx.Param), backbone

    eval_mode = fix == "backbone.eval()"
    head, optimizer, backbone = make(eval_mode)
    want = [float(nnx.jit(transfer_step)(head, optimizer, backbone, *b)) for b in batches]
    strategy = fleet.DistributedStrategy()
    strategy.sync_batch_norm = True
    make_world(4, strategy)
    got_head, got_optimizer, got_backbone = make(False)
    got_head = fleet.distributed_model(got_head)
    got_optimizer = fleet.distributed_optimizer(got_optimizer)
    with pytest.raises(fleet.FleetError, match=(
            r"the step combines different rows .*the BatchNorm layer 'bn' of the 3rd argument "
            r"runs in training mode.*fleet.distributed_model .*\(.eval\(\)\)")):
        fleet.distributed_step(transfer_step)(got_head, got_optimizer, got_backbone, *batches[0])
    if eval_mode:
        got_backbone.eval()
    else:
        got_backbone = fleet.distributed_model(got_backbone)
    step = fleet.distributed_step(transfer_step)
    got = [float(step(got_head, got_optimizer, got_backbone, *b)) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert models.max_diff(models.flat_params(got_head), models.flat_params(head)) < 1e-6
    assert models.max_diff(models.flat_params(got_backbone),
                           models.flat_params(backbone)) < 1e-6
    assert fleet.check_replicas(got_head) == []
    assert fleet.check_replicas(got_backbone) == []


class Observed(nnx.Module):
    """A quantization-calibration observer beside a BatchNorm: the largest
    activation seen and the count of positive inputs seen, kept in nnx.BatchStat
    as such scripts do;
    ``combine`` reduces them over the replicas as the refusal says to."""

    def __init__(self, rngs: nnx.Rngs, combine: bool):
        self.net, self.combine = Net(rngs), combine
        self.amax = nnx.BatchStat(jnp.zeros(()))
        self.seen = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        amax = jnp.abs(jax.lax.stop_gradient(x)).max()
        seen = jnp.sum(x > 0).astype(jnp.float32)
        if self.combine:
            amax, seen = fleet.all_reduce(amax, "max"), fleet.all_reduce(seen, "sum")
        self.amax[...] = jnp.maximum(self.amax[...], amax)
        self.seen[...] += seen
        return self.net(x)


@pytest.mark.parametrize("choice", [True, False])
def test_a_statistic_of_its_own_in_a_batch_stat_is_refused_and_the_fix_equals_one_device(
        make_world, choice):
    """fleet averaged every varying nnx.BatchStat: an observer's maximum came out
    as the mean of the replicas' maxima and a count as 1/N of it (2.55 against
    2.25). It averages only an nnx.BatchNorm's
    running statistics now, and names any other, with the reduction to write."""
    make_world(4, fleet.DistributedStrategy(sync_batch_norm=choice))
    model = fleet.distributed_model(Observed(nnx.Rngs(0), combine=False))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=(
            r"variable 'amax' would hold different values on different replicas.*"
            r"fleet.all_reduce\(value, 'max'\) for a maximum")):
        fleet.distributed_step(train_step)(model, optimizer, *data()[0])

    reference = Observed(nnx.Rngs(0), combine=True)
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(LR), wrt=nnx.Param)
    model = fleet.distributed_model(Observed(nnx.Rngs(0), combine=True))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param))
    step, ref_step = fleet.distributed_step(train_step), nnx.jit(train_step)
    for x, y in data():
        step(model, optimizer, x, y)
        ref_step(reference, ref_optimizer, x, y)
    assert float(model.seen[...]) == float(reference.seen[...]) > 0
    assert float(model.amax[...]) == float(reference.amax[...]) > 0
    if choice:  # the whole step equals one device
        assert distance(state_of(model), state_of(reference)) <= 1e-5
    assert fleet.check_replicas(model) == []
