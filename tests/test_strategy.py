"""The strategy's sections (issue 12), each against a single-device reference.

Where low precision or Adam amplifies float reordering, each case is also
compared with the split-sum reference (the single-device step whose gradient
is the average of the replicas' sub-batch gradients): that distance is the
noise floor, fleet must sit within it, and both distances are printed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models
from tests.jaxpr_utils import count_primitives, psum_bytes
from tests.tiers import slow


def strategy(**sections) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    for name, value in sections.items():
        setattr(s, name, value)
    return s


def recompute_strategy(on: bool, checkpoints: list[str]) -> fleet.DistributedStrategy:
    """recompute on or off; its configs only with it on (configs set without their
    switch change nothing, and fleet.init warns about them)."""
    return strategy(recompute=True, recompute_configs={"checkpoints": checkpoints}) if on \
        else strategy()


def report(name, got, plain, split):
    d_plain, d_split = models.max_diff(got, plain), models.max_diff(got, split)
    floor = models.max_diff(split, plain)
    print(f"{name}: |fleet - single| = {d_plain:.2e}, |fleet - split-sum| = {d_split:.2e}, "
          f"noise floor |split-sum - single| = {floor:.2e}")
    return d_plain, d_split, floor


# -- amp ----------------------------------------------------------------------------------

class BF16CNN(models.CNN):
    """The same CNN with Flax's own mixed precision, written by hand: layers
    compute in bfloat16, parameters stay float32, the logits are float32."""

    def __init__(self, rngs):
        super().__init__(rngs)
        for layer in (self.conv1, self.conv2, self.linear):
            layer.dtype = jnp.bfloat16

    def __call__(self, x):
        return super().__call__(x).astype(jnp.float32)


def single_device(model, tx, data, n_split=None):
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        if n_split:
            grads = models.split_mean_grad(
                lambda a, b: nnx.grad(lambda m: models.loss_of(m(a), b))(model), x, y, n_split)
        else:
            grads = nnx.grad(lambda m: models.loss_of(m(x), y))(model)
        optimizer.update(model, grads)

    for x, y in data:
        step(model, optimizer, x, y)
    return models.flat_params(model)


class NormNet(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(10, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(self.linear1(x)))


@pytest.mark.parametrize("configs, expected", [
    ({}, {"linear1": "bfloat16", "norm": "float32", "head": "bfloat16"}),
    ({"custom_black_list": ["head"]}, {"linear1": "bfloat16", "norm": "float32",
                                       "head": "float32"}),
    ({"custom_white_list": ["LayerNorm"]}, {"linear1": "bfloat16", "norm": "bfloat16",
                                            "head": "bfloat16"}),
    ({"custom_black_list": ["Linear"]}, {"linear1": "float32", "norm": "float32",
                                         "head": "float32"}),
    ({"use_pure_fp16": True}, {"linear1": "float16", "norm": "float16", "head": "float16"}),
    ({"dtype": "float16"}, {"linear1": "float16", "norm": "float32", "head": "float16"}),
])
def test_amp_precision_lists(make_world, configs, expected):
    """Normalisation layers stay float32 by default; the black list adds module
    types or paths, the white list forces layers back to low precision."""
    make_world(2, strategy(amp=True, amp_configs=configs))
    if all(v == "float32" for v in expected.values()):
        with pytest.raises(fleet.FleetConfigError, match="no layer of NormNet"):
            fleet.distributed_model(NormNet(nnx.Rngs(0)))
        return
    model = fleet.distributed_model(NormNet(nnx.Rngs(0)))
    got = {name: jnp.dtype(getattr(model, name).dtype).name for name in expected}
    assert got == expected
    out = model(np.ones((2, 10), np.float32))
    assert out.dtype == jnp.float32



class Head(nnx.Module):
    """A layer of the user's own with a ``dtype`` field and a Flax layer inside."""

    def __init__(self, rngs):
        self.dtype = None
        self.proj = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.proj(x.astype(self.dtype))


class HeadNet(NormNet):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.head = Head(rngs)


@pytest.mark.parametrize("black_list, expected", [
    # a black-listed type is that layer alone: its sub-layers keep their own choice
    (["Head"], {"linear1": "bfloat16", "norm": "float32", "head": "float32",
                "head.proj": "bfloat16"}),
    # a black-listed path holds the layers under it
    (["head"], {"linear1": "bfloat16", "norm": "float32", "head": "float32",
                "head.proj": "float32"}),
    ([], {"linear1": "bfloat16", "norm": "float32", "head": "bfloat16", "head.proj": "bfloat16"}),
])
def test_amp_chooses_each_layer_by_its_own_path_and_type(make_world, black_list, expected):
    make_world(2, strategy(amp=True, amp_configs={"custom_black_list": black_list}))
    model = fleet.distributed_model(HeadNet(nnx.Rngs(0)))
    layers = {".".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
    assert {k: jnp.dtype(layers[k].dtype).name for k in expected} == expected
    assert type(model.head) is Head and type(model.head.proj) is nnx.Linear
    assert model(np.ones((2, 10), np.float32)).dtype == jnp.float32


def test_amp_refused_leaves_the_layers_as_they_were(make_world):
    make_world(2, strategy(amp=True, amp_configs={"custom_black_list": ["Linear"]}))
    net = NormNet(nnx.Rngs(0))
    with pytest.raises(fleet.FleetConfigError, match="no layer of NormNet"):
        fleet.distributed_model(net)
    assert (net.linear1.dtype, net.norm.dtype, net.head.dtype) == (None, None, None)


# -- amp float16: dynamic loss scaling ------------------------------------------------------

def paddle_scale_rules(finite_steps, scale, incr_every, decr_every, incr, decr):
    """Paddle's update_loss_scaling, written out in Python."""
    good = bad = 0
    out = []
    for finite in finite_steps:
        if finite:
            bad, good = 0, good + 1
            if good == incr_every:
                scale = scale * incr if np.isfinite(scale * incr) else scale
                good = 0
        else:
            good, bad = 0, bad + 1
            if bad == decr_every:
                scale, bad = max(scale * decr, 1.0), 0
        out.append(scale)
    return out


FP16 = {"dtype": "float16", "init_loss_scaling": 1024.0, "incr_every_n_steps": 2,
        "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.5}


def test_fp16_a_step_not_finite_on_one_replica_is_skipped_on_all(make_world, tmp_path):
    make_world(4, strategy(amp=True, amp_configs=FP16))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    finite = [True, True, False, False, True, False, True, True, True, False, True]
    data = models.batches("linear", len(finite), 8)
    scales, skipped = [], 0
    for ok, (x, y) in zip(finite, data):
        before = (models.flat_params(model),
                  jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(optimizer.opt_state))),
                  int(optimizer.step[...]))
        if not ok:
            x = x.copy()
            x[2, 0] = np.inf  # replica 1 of 4 (rows 2..3) only
        step(model, optimizer, x, y)
        after = models.flat_params(model)
        if ok:
            assert models.max_diff(after, before[0]) > 0
        else:
            skipped += 1
            assert models.max_diff(after, before[0]) == 0
            state = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(optimizer.opt_state)))
            jax.tree.map(np.testing.assert_array_equal, state, before[1])
            assert int(optimizer.step[...]) == before[2]
        scales.append(float(optimizer.loss_scaling[...]))
        assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    expected = paddle_scale_rules(finite, 1024.0, 2, 2, 2.0, 0.5)
    print("scales:", scales)
    assert scales == expected
    assert int(optimizer.skipped_steps[...]) == skipped
    assert int(optimizer.step[...]) == len(finite) - skipped

    with fleet.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(len(finite), model=model, optimizer=optimizer)
    fresh = fleet.distributed_model(models.LinearNet(nnx.Rngs(1)))
    fresh_opt = fleet.distributed_optimizer(nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param))
    assert float(fresh_opt.loss_scaling[...]) == 1024.0
    with fleet.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore_latest(model=fresh, optimizer=fresh_opt)
    for name in ("loss_scaling", "good_steps", "bad_steps", "skipped_steps"):
        assert float(getattr(fresh_opt, name)[...]) == float(getattr(optimizer, name)[...])


class FP16Net(models.LinearNet):
    """LinearNet with Flax's float16 layers and float32 outputs, written by hand."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self._linear1.dtype = self._linear2.dtype = jnp.float16

    def __call__(self, x):
        return super().__call__(x).astype(jnp.float32)


def fp16_reference(data, k, n_split=None, scale=1024.0, magnitudes=None):
    """One single-device step every k batches on the mean of their gradients,
    the loss scaled by hand; with n_split, each gradient is the split-sum one.
    ``magnitudes`` (a list) gets each update's largest scaled float16 gradient."""
    model = FP16Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def grad(x, y):
        def one(a, b):
            return nnx.grad(lambda m: models.loss_of(m(a), b) * scale)(model)
        return models.split_mean_grad(one, x, y, n_split) if n_split else one(x, y)

    for i in range(0, len(data), k):
        grads = [grad(x, y) for x, y in data[i:i + k]]
        if magnitudes is not None:
            magnitudes.append(max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)))
        optimizer.update(model, jax.tree.map(lambda *g: sum(g) / (k * scale), *grads))
    return models.flat_params(model)


def float16_rounding_bound(lr, k, scale, magnitudes):
    """How far two float16 computations of the same SGD run may end apart.

    A float16 gradient element is rounded to the float16 grid at its magnitude:
    two programs that order or fuse its arithmetic differently (XLA does, on a
    CPU with native float16 arithmetic) may land on neighbouring grid points,
    one unit in the last place (``np.spacing``) apart. Bounded by the largest
    element, each update may then move a parameter by ``lr * ulp(max |g|) /
    scale`` more or less (the mean of k such gradients: the same), and the
    updates add up."""
    return sum(lr * float(np.spacing(np.float16(m))) / scale for m in magnitudes)


@pytest.mark.parametrize("k", [1, 2])
def test_fp16_loss_scaling_leaves_the_gradient_unchanged(make_world, k):
    """The scale multiplies the outputs' cotangent and divides the reduced
    gradient: with float16 compute, fleet equals Flax's float16 layers on one
    device with the loss scaled by hand; also with gradient_merge."""
    n, data = 2, models.batches("linear", 6, 16)
    magnitudes = []
    plain = fp16_reference(data, k, magnitudes=magnitudes)
    split = fp16_reference(data, k, n_split=n)
    bound = float16_rounding_bound(0.1, k, 1024.0, magnitudes)
    s = strategy(amp=True, amp_configs={**FP16, "use_dynamic_loss_scaling": False})
    if k > 1:
        s.gradient_merge, s.gradient_merge_configs = True, {"k_steps": k}
    make_world(n, s)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in data:
        step(model, optimizer, x, y)
    d_plain, d_split, floor = report(f"amp fp16, static scale 1024, k={k}",
                                     models.flat_params(model), plain, split)
    print(f"float16 rounding bound: {bound:.2e} (largest scaled gradients: "
          f"{', '.join(f'{m:.1f}' for m in magnitudes)})")
    # float16_rounding_bound: one float16 unit of the largest gradient per update.
    # Measured on a CPU with native float16 (avx512_fp16): |fleet - split-sum| =
    # 8.1e-5 (k=1) and 3.1e-5 (k=2).
    assert d_split <= bound
    assert d_plain <= floor + bound  # |fleet - single| <= |fleet - split| + |split - single|
    assert float(optimizer.loss_scaling[...]) == 1024.0
    assert int(optimizer.step[...]) == len(data) // k


class BF16NormNet(NormNet):
    """NormNet with Flax's own policy written by hand: the linear layers in
    bfloat16, the LayerNorm in float32, float32 outputs."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.linear1.dtype = self.head.dtype = jnp.bfloat16
        self.norm.dtype = jnp.float32

    def __call__(self, x):
        return super().__call__(x).astype(jnp.float32)


@pytest.mark.parametrize("net, hand_written, kind, n", [
    pytest.param(models.CNN, BF16CNN, "cnn", 1, marks=slow),  # (NormNet keeps 1 device)
    pytest.param(models.CNN, BF16CNN, "cnn", 2, marks=slow),
    (models.CNN, BF16CNN, "cnn", 4),
    (NormNet, BF16NormNet, "linear", 1), (NormNet, BF16NormNet, "linear", 4),
])
def test_amp_bf16_equals_the_hand_written_flax_policy(make_world, net, hand_written, kind, n):
    """strategy.amp trains what Flax's own mixed precision, written by hand,
    trains: layers in bfloat16, the LayerNorm in float32, float32 parameters."""
    data = models.batches(kind, 8, 16)
    tx = optax.sgd(0.05)
    plain = single_device(hand_written(nnx.Rngs(0)), tx, data)
    split = single_device(hand_written(nnx.Rngs(0)), tx, data, n_split=n)

    make_world(n, strategy(amp=True))
    model = fleet.distributed_model(net(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    losses = [step(model, optimizer, x, y) for x, y in data]
    got = models.flat_params(model)
    assert all(loss.dtype == jnp.float32 for loss in losses)
    assert all(v.dtype == np.float32 for v in got.values())
    d_plain, d_split, floor = report(f"amp bf16, {net.__name__}, {n} devices", got, plain, split)
    # On one device fleet runs the same program as the reference. On more, it
    # runs the split-sum reference's arithmetic (bf16 per replica, float32 sum).
    assert d_split < 1e-6
    assert d_plain <= max(1e-6, 2 * floor)
    assert fleet.check_replicas(model) == []


def test_fp16_needs_the_distributed_optimizer_in_the_step(make_world):
    make_world(2, strategy(amp=True, amp_configs={"dtype": "float16"}))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    with pytest.raises(fleet.FleetError, match="scales the loss.*fleet.distributed_optimizer"):
        step(model, optimizer, *models.batches("linear", 1, 8)[0])


# -- recompute ------------------------------------------------------------------------------

class Block(nnx.Module):
    """An MLP block whose hidden activations only backward needs."""

    def __init__(self, width, rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.down(jnp.tanh(self.up(x))))


class MLP6(nnx.Module):
    """Six MLP blocks."""

    def __init__(self, rngs, width=64):
        self.embed = nnx.Linear(10, width, rngs=rngs)
        self.layers = nnx.List([Block(width, rngs) for _ in range(6)])
        self.head = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def grads_step(model, x, y):
    return nnx.grad(lambda m: models.loss_of(m(x), y))(model)


def test_recompute_keeps_gradients_and_lowers_memory(make_world):
    x, y = models.batches("linear", 1, 512)[0]
    results = {}
    for recompute in (False, True):
        s = recompute_strategy(recompute, [f"layers.{i}" for i in range(6)])
        make_world(4, s)
        model = fleet.distributed_model(MLP6(nnx.Rngs(0)))
        step = fleet.distributed_step(grads_step)
        memory = step.lower(model, x, y).compile().memory_analysis()
        results[recompute] = (models.flat_params(nnx.to_pure_dict(step(model, x, y))),
                              memory.temp_size_in_bytes)
    diff = models.max_diff(results[True][0], results[False][0])
    print(f"recompute: |grads - grads without recompute| = {diff:.2e}; compiled temp bytes "
          f"{results[False][1]} without, {results[True][1]} with recompute")
    assert diff <= 1e-6
    assert results[True][1] < results[False][1]


def test_recompute_names_a_missing_sub_module(make_world):
    make_world(2, strategy(recompute=True, recompute_configs={"checkpoints": ["layer.0"]}))
    with pytest.raises(fleet.FleetConfigError, match=r"names \['layer.0'\].*layers.0"):
        fleet.distributed_model(MLP6(nnx.Rngs(0)))



def remat_count(jaxpr) -> int:
    """Rematerialised regions (``jax.checkpoint``) in a jaxpr, by JAX's own name."""
    names = {e.primitive.name for e in jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns}
    return count_primitives(jaxpr, tuple(names))


class CheckedMLP(MLP6):
    """MLP6 whose own code looks at its blocks while calling them."""

    def __call__(self, x):
        x = self.embed(x)
        for layer in self.layers:
            assert isinstance(layer, Block) and layer.up.in_features == x.shape[-1]
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("net, checkpoints, regions", [
    (MLP6, ["layers.1", "layers.4"], 2),
    # layers.0.up inside layers.0: JAX differentiates a nested jax.checkpoint into
    # three regions (the outer one's forward, and its backward holding the inner
    # one), as it does for plain functions; head adds one
    (MLP6, ["layers.0", "layers.0.up", "head"], 4),
    (CheckedMLP, ["layers.2"], 1),
])
def test_recompute_keeps_the_state_and_changes_class_at_the_one_point(make_world, net,
                                                                      checkpoints, regions):
    """The named sub-modules become Recompute<their class> (through
    fleet._compat.add_mixin, the one documented point: isinstance holds, their
    class is next in the MRO), no other module changes class, and the model keeps
    its state paths; in a step they run under jax.checkpoint and the gradients
    are those without recompute; outside a step the model runs as written."""
    x, y = models.batches("linear", 1, 64)[0]
    reference = net(nnx.Rngs(0), width=16)
    single = models.flat_params(nnx.to_pure_dict(grads_step(reference, x, y)))
    paths = [p for p, _ in nnx.iter_modules(reference)]
    classes = {p: type(m) for p, m in nnx.iter_modules(reference)}

    grads = {}
    for on in (False, True):
        make_world(2, recompute_strategy(on, checkpoints))
        model = fleet.distributed_model(net(nnx.Rngs(0), width=16))
        step = fleet.distributed_step(grads_step)
        assert remat_count(step.make_jaxpr(model, x, y)) == (regions if on else 0)
        grads[on] = models.flat_params(nnx.to_pure_dict(step(model, x, y)))

    named = {".".join(map(str, p)) for p, _ in nnx.iter_modules(model)} & set(checkpoints)
    for p, m in nnx.iter_modules(model):  # its own class, or Recompute<its class> if named
        name = ".".join(map(str, p))
        if name in named:
            assert type(m).__name__ == f"Recompute{classes[p].__name__}"
            assert type(m).__bases__[-1] is classes[p] and isinstance(m, classes[p])
        elif p:
            assert type(m) is classes[p]
    assert [p for p, _ in nnx.iter_modules(model)] == paths
    assert [p for p, _ in nnx.to_flat_state(nnx.state(model))] == [
        p for p, _ in nnx.to_flat_state(nnx.state(reference))]
    diff = models.max_diff(grads[True], grads[False])
    print(f"recompute {checkpoints}: |grads - grads without recompute| = {diff:.2e}, "
          f"|grads - one device| = {models.max_diff(grads[True], single):.2e}")
    assert diff <= 1e-6
    # the mean over 2 replicas orders the sum differently from one device
    assert models.max_diff(grads[True], single) <= 1e-5

    graphdef, state = nnx.split(model)  # outside a step: the model as written
    assert remat_count(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x))(state)) == 0
    np.testing.assert_allclose(model(x), reference(x), rtol=1e-6, atol=1e-6)


def test_a_checkpoint_moves_between_recompute_on_and_off(make_world, tmp_path):
    """Recompute changes no state key: a model saved with it on loads with it off,
    and the other way round."""
    x, y = models.batches("linear", 1, 64)[0]
    trained, saved = {}, {}
    for on in (True, False):
        make_world(2, recompute_strategy(on, ["layers.3"]))
        model = fleet.distributed_model(MLP6(nnx.Rngs(0 if on else 1), width=16))
        optimizer = fleet.distributed_optimizer(
            nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
        step = fleet.distributed_step(models.nnx_train_step)
        step(model, optimizer, x, y)
        saved[on] = model.state_dict()
        fleet.save(saved[on], tmp_path / f"on={on}.pdparams")
        trained[on] = model
    for on in (True, False):
        other = trained[not on]
        other.set_state_dict(fleet.load(tmp_path / f"on={on}.pdparams"))
        assert models.max_diff(other.state_dict(), saved[on]) == 0


# -- gradient_merge -------------------------------------------------------------------------

def merge_reference(data, tx, k, avg, n_split=None):
    """One single-device step every k batches, on the mean (avg) or the sum of
    their gradients; with n_split, each batch's gradient is the split-sum one."""
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def grad(x, y):
        if n_split:
            return models.split_mean_grad(
                lambda a, b: nnx.grad(lambda m: models.loss_of(m(a), b))(model), x, y, n_split)
        return nnx.grad(lambda m: models.loss_of(m(x), y))(model)

    for i in range(0, len(data), k):
        grads = [grad(x, y) for x, y in data[i:i + k]]
        total = jax.tree.map(lambda *g: sum(g) / (k if avg else 1), *grads)
        optimizer.update(model, total)
    return models.flat_params(model)


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=slow)])  # (k=2: both optimizers, both avg)
@pytest.mark.parametrize("avg", [True, False])
@pytest.mark.parametrize("tx_name", ["sgd", "adam"])
def test_gradient_merge_equals_the_merged_single_device_step(make_world, k, avg, tx_name):
    n = 4
    tx = {"sgd": optax.sgd(0.05), "adam": optax.adam(models.LR)}[tx_name]
    data = models.batches("linear", 2 * k, 8)
    plain = merge_reference(data, tx, k, avg)
    split = merge_reference(data, tx, k, avg, n_split=n)

    make_world(n, strategy(gradient_merge=True, gradient_merge_configs={"k_steps": k, "avg": avg}))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for i, (x, y) in enumerate(data):
        psums = count_primitives(step.make_jaxpr(model, optimizer, x, y))
        assert psums == (4 if i % k == k - 1 else 0), (i, psums)  # 4 leaves on the k-th call
        step(model, optimizer, x, y)
        assert int(optimizer.step[...]) == (i + 1) // k
    d_plain, d_split, floor = report(f"gradient_merge k={k} avg={avg} {tx_name}",
                                     models.flat_params(model), plain, split)
    assert d_split < 1e-5
    assert d_plain <= max(1e-5, 2 * floor)
    assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []


def test_gradient_merge_save_on_call_k_minus_1_restores_exactly(make_world, tmp_path):
    k = 4
    data = models.batches("linear", 2 * k, 8)
    make_world(4, strategy(gradient_merge=True, gradient_merge_configs={"k_steps": k}))

    def build():
        model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
        opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR),
                                                        wrt=nnx.Param))
        return model, opt, fleet.distributed_step(models.nnx_train_step)

    model, opt, step = build()
    for x, y in data:
        step(model, opt, x, y)
    straight = models.flat_params(model)

    model, opt, step = build()
    for x, y in data[:k + k - 1]:  # the save falls on call k-1 of the second cycle
        step(model, opt, x, y)
    with fleet.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(k + k - 1, model=model, optimizer=opt)
    model, opt, step = build()
    with fleet.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore_latest(model=model, optimizer=opt)
    assert int(opt.merge_count[...]) == k - 1
    step(model, opt, *data[-1])
    assert int(opt.step[...]) == 2
    assert models.max_diff(models.flat_params(model), straight) == 0


def test_gradient_merge_needs_the_distributed_optimizer(make_world):
    make_world(2, strategy(gradient_merge=True, gradient_merge_configs={"k_steps": 2}))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    with pytest.raises(fleet.FleetError, match="gradient_merge.*fleet.distributed_optimizer"):
        step(model, optimizer, *models.batches("linear", 1, 8)[0])


# -- fp16_allreduce -------------------------------------------------------------------------

def test_fp16_allreduce_halves_the_bytes_within_bf16_rounding(make_world):
    data = models.batches("cnn", 30, 16)
    runs = {}
    for compress in (False, True):
        make_world(4, strategy(fp16_allreduce=compress))
        model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
        optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.05),
                                                              wrt=nnx.Param))
        step = fleet.distributed_step(models.nnx_train_step)
        wire = psum_bytes(step.make_jaxpr(model, optimizer, *data[0]))
        for x, y in data:
            step(model, optimizer, x, y)
        runs[compress] = (models.flat_params(model), wire)
    diff = models.max_diff(runs[True][0], runs[False][0])
    scale = max(float(np.abs(v).max()) for v in runs[False][0].values())
    print(f"fp16_allreduce: |bf16 buckets - fp32 buckets| after 30 steps = {diff:.2e} "
          f"(largest parameter {scale:.2f}); psum bytes per step {runs[False][1]} -> "
          f"{runs[True][1]}")
    assert set(runs[True][1]) == {"bfloat16"} and set(runs[False][1]) == {"float32"}
    assert runs[True][1]["bfloat16"] * 2 == runs[False][1]["float32"]
    assert 0 < diff < 2 ** -8 * scale  # bf16 keeps 8 bits: within its rounding, not equal


# -- sections refused where they cannot act -------------------------------------------------

@pytest.mark.parametrize("sections, match", [
    ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
     r"gradient_merge \(k_steps=2\) lives in a distributed nnx.Optimizer"),
    ({"amp": True, "amp_configs": {"dtype": "float16"}}, "float16 amp"),
])
def test_sections_that_need_the_nnx_optimizer_refuse_an_optax_transformation(
        make_world, sections, match):
    make_world(2, strategy(**sections))
    with pytest.raises(fleet.FleetUnsupportedError, match=match + ".*nnx.Optimizer\\(model"):
        fleet.distributed_optimizer(optax.sgd(0.1))


def test_amp_refuses_a_step_on_raw_parameters(make_world):
    """amp acts through a wrapped model's layers; raw parameters would silently
    train in float32."""
    make_world(2, strategy(amp=True))
    model = models.LinearNet(nnx.Rngs(0))
    tx = fleet.distributed_optimizer(optax.sgd(0.1))
    params = nnx.state(model, nnx.Param)
    graphdef = nnx.graphdef(model)
    opt_state = tx.init(params)

    @fleet.distributed_step(batch_argnums=(2, 3))
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: models.loss_of(nnx.merge(graphdef, p)(x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with pytest.raises(fleet.FleetError, match="strategy.amp.*raw parameters.*distributed_model"):
        step(params, opt_state, *models.batches("linear", 1, 8)[0])


def test_an_explicit_no_sync_call_accumulates_without_counting_in_the_merge(make_world):
    """gradient_merge k=2 with a no_sync call in between: three calls, one
    optimizer step, on the sum of all three local gradients divided by k."""
    data = models.batches("linear", 3, 8)
    reference = models.LinearNet(nnx.Rngs(0))
    grads = [nnx.grad(lambda m, x=x, y=y: models.loss_of(m(x), y))(reference) for x, y in data]
    expected = {key: value - sum(models.flat_params(nnx.to_pure_dict(g))[key] for g in grads) / 2
                for key, value in models.flat_params(reference).items()}
    make_world(4, strategy(gradient_merge=True, gradient_merge_configs={"k_steps": 2}))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    step(model, optimizer, *data[0])
    with model.no_sync():
        step(model, optimizer, *data[1])
    assert int(optimizer.step[...]) == 0
    step(model, optimizer, *data[2])
    assert int(optimizer.step[...]) == 1
    diff = models.max_diff(models.flat_params(model), expected)
    print(f"gradient_merge + no_sync: |fleet - expected| = {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("amp_configs, wire", [({}, "bfloat16"), ({"dtype": "float16"}, "float16"),
                                               ({"use_pure_fp16": True}, "float16")])
def test_fp16_allreduce_travels_in_float16_when_amp_configs_say_so(make_world, amp_configs, wire):
    make_world(2, strategy(fp16_allreduce=True, amp_configs=amp_configs))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    assert set(psum_bytes(step.make_jaxpr(model, optimizer, *models.batches("linear", 1, 8)[0]))) \
        == {wire}
