"""Acceptance: replicas start identical, even when each device's parameters were
made different on purpose; state_dict keys are the unwrapped model's."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from fleet.comm import _replicas
from tests import models


def different_on_each_device(value: np.ndarray, world) -> jax.Array:
    """A 'replicated' array whose copies differ: device i holds value + i."""
    shards = [jax.device_put(value + i, d) for i, d in enumerate(world.mesh.devices.flat)]
    return jax.make_array_from_single_device_arrays(value.shape, world.replicated, shards)


def copies(x: jax.Array) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in x.addressable_shards]


def test_replicas_start_identical(make_world):
    world = make_world(4)
    model = models.LinearNet(nnx.Rngs(0))
    kernel = np.asarray(model._linear1.kernel.get_value())
    model._linear1.kernel.set_value(different_on_each_device(kernel, world))
    assert not np.array_equal(*copies(model._linear1.kernel.get_value())[:2])

    dp = fleet.distributed_model(model)
    for var in [dp._linear1.kernel, dp._linear1.bias, dp._linear2.kernel]:
        value = var.get_value()
        assert value.sharding.is_equivalent_to(world.replicated, value.ndim)
        first, *rest = copies(value)
        for other in rest:
            np.testing.assert_array_equal(first, other)
    np.testing.assert_array_equal(copies(dp._linear1.kernel.get_value())[0], kernel)  # device 0's


def test_training_keeps_replicas_identical(make_world):
    make_world(8)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in models.batches("linear", 5, 16):
        step(model, optimizer, x, y)
    for path, var in nnx.to_flat_state(nnx.state((model, optimizer))):
        first, *rest = copies(var.get_value())
        for other in rest:
            np.testing.assert_array_equal(first, other, err_msg=str(path))


def test_wrapper_is_the_model(make_world):
    make_world(2)
    inner = models.LinearNet(nnx.Rngs(0))
    dp = fleet.distributed_model(inner)
    assert isinstance(dp, models.LinearNet) and isinstance(dp, fleet.DataParallel)
    assert dp._linear1 is inner._linear1  # same variables: training one trains the other
    x = np.ones((4, 10), np.float32)
    np.testing.assert_allclose(np.asarray(dp(x)), np.asarray(inner(x)))


def test_state_dict_has_the_unwrapped_keys_and_round_trips(make_world):
    make_world(4)
    single = models.LinearNet(nnx.Rngs(1))
    single_keys = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(single))}
    dp = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    assert set(dp.state_dict()) == single_keys == {
        "_linear1.kernel", "_linear1.bias", "_linear2.kernel", "_linear2.bias"}

    # A single-card checkpoint loads into the distributed model, replicated.
    saved = {k: np.asarray(v.get_value()) for k, v in
             ((".".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(single)))}
    dp.set_state_dict(saved)
    for key, value in dp.state_dict().items():
        np.testing.assert_array_equal(value, saved[key])
    assert dp._linear1.kernel.get_value().sharding.is_fully_replicated


def test_set_state_dict_rejects_a_mismatch_and_changes_nothing(make_world):
    make_world(2)
    dp = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    before = dp.state_dict()
    bad = dict(before)
    bad["_linear1.kernel"] = np.zeros((3, 3), np.float32)
    del bad["_linear2.bias"]
    bad["extra.weight"] = np.zeros(2)
    with pytest.raises(fleet.FleetError, match=r"missing '_linear2.bias'.*unexpected 'extra.weight'"
                       r".*'_linear1.kernel': model has \(10, 10\) float32, given \(3, 3\)"):
        dp.set_state_dict(bad)
    after = dp.state_dict()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


def test_linen_state_dict_round_trip(make_world):
    make_world(2)
    dp = fleet.distributed_model(models.LinenLinearNet())
    variables = dp.init(jax.random.key(0), np.ones((1, 10), np.float32))
    sd = dp.state_dict(variables)
    assert set(sd) == {"params.Dense_0.kernel", "params.Dense_0.bias",
                       "params.Dense_1.kernel", "params.Dense_1.bias"}
    restored = dp.set_state_dict(sd, variables)
    assert models.max_diff(models.flat_params(restored), models.flat_params(variables)) == 0


class WithDropout(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def test_state_dict_with_rng_state(make_world):
    """PRNG keys (dropout's RNG stream) are replicated and saved as key data."""
    make_world(2)
    dp = fleet.distributed_model(WithDropout(nnx.Rngs(0)))
    sd = dp.state_dict()
    assert {"linear.kernel", "dropout.rngs.key", "dropout.rngs.count"} <= set(sd)
    assert sd["dropout.rngs.key"].dtype == np.uint32
    other = fleet.distributed_model(WithDropout(nnx.Rngs(1)))
    other.set_state_dict(sd)
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(value, sd[key])


class WithBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(10, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def test_batch_norm_statistics_are_averaged_over_replicas(make_world):
    """strategy.sync_batch_norm = False, chosen explicitly (issue 21: not choosing
    raises): each replica normalises with its own rows (as DDP without
    SyncBatchNorm), but the running statistics leave the step equal on every
    replica: the average of the replicas' running means is the single-device
    running mean."""
    x, y = models.batches("linear", 1, 16)[0]
    y = np.repeat(y, 4, axis=1)
    reference = WithBatchNorm(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    nnx.jit(models.nnx_train_step)(reference, ref_opt, x, y)

    make_world(4, fleet.DistributedStrategy(sync_batch_norm=False))
    model = fleet.distributed_model(WithBatchNorm(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    fleet.distributed_step(models.nnx_train_step)(model, optimizer, x, y)
    for var in (model.norm.mean, model.norm.var):
        first, *rest = copies(var.get_value())
        for other in rest:
            np.testing.assert_array_equal(first, other)
    np.testing.assert_allclose(np.asarray(model.norm.mean.get_value()),
                               np.asarray(reference.norm.mean.get_value()), atol=1e-6)


def test_check_replicas_finds_a_copy_made_different(make_world):
    """Acceptance 3 of issue 9: fleet.check_replicas names the leaf and the devices."""
    world = make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    assert fleet.check_replicas(model) == []
    kernel = np.asarray(model._linear2.kernel.get_value())
    model._linear2.kernel.set_raw_value(different_on_each_device(kernel, world))
    found = fleet.check_replicas(model)
    assert len(found) == 1 and found[0].startswith("_linear2.kernel"), found
    assert "device(s) [1, 2, 3]" in found[0]


DTYPES = {  # a value, and the same value with one element's lowest bit changed
    "float32": (np.linspace(-1, 1, 4097, dtype=np.float32),
                lambda a: a.view(np.uint32).__setitem__(2048, a.view(np.uint32)[2048] ^ 1)),
    "bfloat16": (np.linspace(-1, 1, 300).astype(jax.numpy.bfloat16),
                 lambda a: a.view(np.uint16).__setitem__(7, a.view(np.uint16)[7] ^ 1)),
    "int8": (np.arange(-50, 50, dtype=np.int8), lambda a: a.__setitem__(99, a[99] ^ 1)),
    "bool": (np.ones((3, 5), bool), lambda a: a.__setitem__((2, 4), False)),
    "complex64": (np.full(6, 1 + 2j, np.complex64), lambda a: a.__setitem__(5, 1 + 3j)),
    "scalar": (np.float32(3.0), None),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_check_replicas_sees_one_bit_on_one_device(make_world, dtype):
    """The copies are compared bit for bit (issue 22 item 9): one changed bit of one
    element, on one device, is named; equal copies pass. Both ways of comparing:
    in place on CPU, and by on-device fingerprints (accelerators)."""
    world = make_world(4)
    value, flip = DTYPES[dtype]
    value = np.array(value)
    changed = value.copy()
    if flip is None:
        changed = changed + np.float32(2.0 ** -20)
    else:
        flip(changed)
    assert not np.array_equal(np.atleast_1d(changed).view(np.uint8), np.atleast_1d(value).view(np.uint8))
    devices = list(world.mesh.devices.flat)
    shards = [jax.device_put(changed if i == 2 else value, d) for i, d in enumerate(devices)]
    tree = {"same": jax.device_put(value, world.replicated),
            "x": jax.make_array_from_single_device_arrays(value.shape, world.replicated, shards)}
    found = fleet.check_replicas(tree)
    assert found == [f"x (device {devices[0].id} and device(s) [{devices[2].id}])"], found
    # The accelerators' path (fingerprints computed on each device), run on these CPU ones.
    prints = _replicas._fingerprints([tree["same"], tree["x"]])  # [copy, leaf, 2]
    differs = [[bool((prints[i, j] != prints[0, j]).any()) for i in range(4)] for j in (0, 1)]
    assert differs == [[False] * 4, [False, False, True, False]], prints


def test_the_strategy_checks_replicas_while_training(make_world):
    """check_replicas_every_n_steps: the next check step raises, naming the leaf."""
    strategy = fleet.DistributedStrategy(check_replicas_every_n_steps=2)
    world = make_world(4, strategy)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    data = models.batches("linear", 3, 8)
    step(model, optimizer, *data[0])
    step(model, optimizer, *data[1])  # a check step: all equal
    bias = np.asarray(model._linear1.bias.get_value())
    model._linear1.bias.set_raw_value(different_on_each_device(bias, world))
    step(model, optimizer, *data[2])  # not a check step
    with pytest.raises(fleet.FleetError, match=r"differ across replicas after call 4: "
                                               r"the 1st argument \(.*\) variable '_linear1.bias'"):
        step(model, optimizer, *data[2])


def test_state_dict_takes_paddles_arguments(make_world):
    """Paddle's Layer.state_dict(destination=None, include_sublayers=True,
    structured_name_prefix='') and set_state_dict(state_dict, use_structured_name=True)."""
    make_world(2)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.scale = nnx.Param(jax.numpy.ones(()))  # the layer's own parameter
            self.linear = nnx.Linear(3, 2, rngs=rngs)

    dp = fleet.distributed_model(Net(nnx.Rngs(0)))
    full = dp.state_dict()
    assert set(full) == {"scale", "linear.kernel", "linear.bias"}
    own = dp.state_dict(include_sublayers=False)  # only the layer's own variables
    assert set(own) == {"scale"}
    destination = {"already": np.zeros(1)}
    assert dp.state_dict(destination=destination) is destination  # filled and returned
    assert set(destination) == {"already", *full}
    assert set(dp.state_dict(structured_name_prefix="net.")) == {f"net.{k}" for k in full}

    changed = {k: v * 2 for k, v in full.items()}
    dp.set_state_dict(changed)  # by name
    for key, value in dp.state_dict().items():
        np.testing.assert_array_equal(value, changed[key])
    in_order = {f"p{i}": v for i, v in enumerate(full.values())}  # other names, same order
    dp.set_state_dict(in_order, use_structured_name=False)  # matched in order
    for key, value in dp.state_dict().items():
        np.testing.assert_array_equal(value, full[key])
    with pytest.raises(fleet.FleetError, match="with use_structured_name=False they are "
                                               "matched in order"):
        dp.set_state_dict({"only": np.ones(())}, use_structured_name=False)
