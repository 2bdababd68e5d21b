"""Loops inside a step (issue 33: "scan", "a collective over another axis name").

* Gradient accumulation over micro-batches with ``jax.lax.scan`` (NNX through
  ``nnx.split`` / ``nnx.merge``, NNX through ``nnx.scan``, Linen's ``TrainState``)
  trains as the single-device step on the global batch, once its loss carry starts
  per replica (``jnp.zeros_like(x, shape=())``); a carry started at ``0.0`` is
  refused naming the loop's line and what to write, not blamed on one device.
* NNX's scan over layers (blocks made by ``nnx.vmap``, applied by ``nnx.scan``,
  with and without ``nnx.remat``) and Linen's ``nn.scan`` over layers train as the
  single-device step: the wrapped model's parameters enter the scan synced.
* A collective over an axis other than ``data`` is refused naming the axis and the
  line that called it.

Each training case: SGD, 3 steps, fp32; parameters and returned losses within 1e-5
of ``nnx.jit`` / ``jax.jit`` on one device, and ``fleet.check_replicas`` empty.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training.train_state import TrainState

import fleet
from tests import models, tiers

DEVICES = tiers.replicas(1, 2, 4, 8)
STEPS, BATCH, K, LAYERS, TOL = 3, 16, 2, 3, 1e-5
HERE = re.escape(__file__)


def micro(x, y):
    return x.reshape(K, -1, *x.shape[1:]), y.reshape(K, -1, *y.shape[1:])


def mb_loss(model, mb):
    return models.loss_of(model(mb[0]), mb[1])


# -- gradient accumulation with jax.lax.scan -------------------------------------------

def accum_split(model, optimizer, x, y, start=None):
    """NNX through split / merge: the loss and the gradients summed in the carry."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def body(carry, mb):
        loss_sum, g_sum = carry
        loss, g = jax.value_and_grad(lambda p: mb_loss(nnx.merge(graphdef, p, rest), mb))(params)
        return (loss_sum + loss, jax.tree.map(jnp.add, g_sum, g)), None

    g0 = jax.tree.map(jnp.zeros_like, params)
    init = jnp.zeros_like(x, shape=()) if start is None else start
    (loss_sum, g_sum), _ = jax.lax.scan(body, (init, g0), micro(x, y))
    optimizer.update(model, jax.tree.map(lambda g: g / K, g_sum))
    return loss_sum / K


def accum_nnx_scan(model, optimizer, x, y):
    """NNX through nnx.scan, the model broadcast into the loop."""

    @nnx.scan(in_axes=(nnx.Carry, None, 0), out_axes=nnx.Carry)
    def body(carry, model, mb):
        loss_sum, g_sum = carry
        loss, g = nnx.value_and_grad(mb_loss)(model, mb)
        return loss_sum + loss, jax.tree.map(jnp.add, g_sum, g)

    g0 = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    loss_sum, g_sum = body((jnp.zeros_like(x, shape=()), g0), model, micro(x, y))
    optimizer.update(model, jax.tree.map(lambda g: g / K, g_sum))
    return loss_sum / K


def accum_linen(state, x, y):
    """Linen: a TrainState, jax.value_and_grad of its apply_fn."""

    def body(carry, mb):
        loss_sum, g_sum = carry
        loss, g = jax.value_and_grad(
            lambda p: models.loss_of(state.apply_fn({"params": p}, mb[0]), mb[1]))(state.params)
        return (loss_sum + loss, jax.tree.map(jnp.add, g_sum, g)), None

    g0 = jax.tree.map(jnp.zeros_like, state.params)
    (loss_sum, g_sum), _ = jax.lax.scan(body, (jnp.zeros_like(x, shape=()), g0), micro(x, y))
    return state.apply_gradients(grads=jax.tree.map(lambda g: g / K, g_sum)), loss_sum / K


def train_nnx(make, step, data, distributed):
    model = make(nnx.Rngs(0))
    if distributed:
        model = fleet.distributed_model(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    run = fleet.distributed_step(step) if distributed else nnx.jit(step)
    losses = [float(run(model, optimizer, x, y)) for x, y in data]
    return losses, models.flat_params(model), model, optimizer


def train_linen(module, step, data, distributed):
    if distributed:
        module = fleet.distributed_model(module)
    params = module.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=module.apply, params=params, tx=optax.sgd(0.05))
    run = fleet.distributed_step(step) if distributed else jax.jit(step)
    losses = []
    for x, y in data:
        state, loss = run(state, x, y)
        losses.append(float(loss))
    return losses, models.flat_params(state.params), state, None


def assert_same(name, got, ref):
    (losses, params, *objs), (ref_losses, ref_params, *_) = got, ref
    d_params = models.max_diff(params, ref_params)
    d_loss = float(np.abs(np.subtract(losses, ref_losses)).max())
    print(f"{name}: |params - single device| = {d_params:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < TOL and d_loss < TOL, name
    for obj in objs:
        if obj is not None:
            assert fleet.check_replicas(obj) == [], name


ACCUM = {
    "nnx split/merge": lambda data, d: train_nnx(models.LinearNet, accum_split, data, d),
    "nnx.scan": lambda data, d: train_nnx(models.LinearNet, accum_nnx_scan, data, d),
    "linen TrainState": lambda data, d: train_linen(models.LinenLinearNet(), accum_linen, data, d),
}


def matches_one_device(make_world, n, label, run):
    data = models.batches("linear", STEPS, BATCH)
    ref = run(data, False)
    make_world(n)
    assert_same(f"{label} on {n}", run(data, True), ref)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("case", list(ACCUM))
def test_gradient_accumulation_with_scan_matches_one_device(make_world, n, case):
    matches_one_device(make_world, n, f"accumulation ({case})", ACCUM[case])


@pytest.mark.parametrize("n", tiers.devices(1, 4))
def test_a_loss_carry_started_at_zero_is_refused_naming_the_loop(make_world, n):
    """The carry starts at 0.0 (the same on every replica) and comes out
    per-replica: JAX's scan refuses the changed type, and fleet cannot cast the
    user's constant. The error names the loop's line (this file's) and what to
    write, and does not blame the single device (the step runs there)."""
    data = models.batches("linear", 1, BATCH)
    make_world(n)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    step = fleet.distributed_step(lambda m, o, x, y: accum_split(m, o, x, y, start=0.0))
    source, first = inspect.getsourcelines(accum_split)
    line = first + next(i for i, text in enumerate(source) if "jax.lax.scan(" in text)
    with pytest.raises(fleet.FleetError, match=(
            rf"loop at {HERE}:{line} carries a value that starts the same on every replica "
            r"and comes out different on each \(jax\.lax\.scan carry 0 \(float32\[\]\)\).*"
            r"jnp\.zeros_like\(x, shape=\(\)\).*jax\.lax\.pcast\(0\.0, fleet\.DATA_AXIS")) as info:
        step(model, optimizer, *data[0])
    assert "single-device" not in str(info.value)


# -- scan over layers ------------------------------------------------------------------

class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(10, 10, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class ScannedNet(nnx.Module):
    """Flax's scan over layers: blocks made by nnx.vmap, applied by nnx.scan."""

    def __init__(self, rngs: nnx.Rngs, remat: bool = False):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(10, 1, rngs=rngs)
        self.remat = remat

    def __call__(self, x):
        remat = self.remat

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            if remat:
                return nnx.remat(lambda b, h: b(h))(block, x)
            return block(x)

        return self.head(forward(x, self.blocks))


class LinenBlock(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        return jnp.tanh(linen.Dense(10)(x)), None


class LinenScannedNet(linen.Module):
    @linen.compact
    def __call__(self, x):
        blocks = linen.scan(LinenBlock, variable_axes={"params": 0},
                            split_rngs={"params": True}, length=LAYERS)
        x, _ = blocks()(x, None)
        return linen.Dense(1)(x)


LAYER_SCANS = {
    "nnx.scan": lambda data, d: train_nnx(ScannedNet, models.nnx_train_step, data, d),
    "nnx.scan + nnx.remat": lambda data, d: train_nnx(
        lambda rngs: ScannedNet(rngs, remat=True), models.nnx_train_step, data, d),
    "linen nn.scan": lambda data, d: train_linen(LinenScannedNet(), models.linen_train_step,
                                                 data, d),
}


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("case", list(LAYER_SCANS))
def test_scan_over_layers_matches_one_device(make_world, n, case):
    matches_one_device(make_world, n, f"scan over layers ({case})", LAYER_SCANS[case])


# -- a collective over another axis name ----------------------------------------------

def _loss(model, optimizer, x, y):
    return models.nnx_train_step(model, optimizer, x, y)


UNBOUND = {  # the step's last line -> the collective named
    "pmean": (lambda m, o, x, y: jax.lax.pmean(_loss(m, o, x, y), axis_name="batch"), "pmean"),
    "psum": (lambda m, o, x, y: jax.lax.psum(_loss(m, o, x, y), "batch") / 4, "psum"),
    "all_gather": (lambda m, o, x, y: jax.lax.all_gather(_loss(m, o, x, y), "batch").mean(),
                   "all_gather"),
    "axis_index": (lambda m, o, x, y: _loss(m, o, x, y) * jax.lax.axis_index("batch"),
                   "axis_index"),
}


@pytest.mark.parametrize("case", list(UNBOUND))
def test_a_collective_over_another_axis_names_the_axis_and_the_line(make_world, case):
    fn, name = UNBOUND[case]
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    line = inspect.getsourcelines(fn)[1]
    with pytest.raises(fleet.FleetError, match=(
            rf"collective over an axis other than fleet's 'data': jax\.lax\.{name}\(\.\.\., "
            rf"axis_name='batch'\) at {HERE}:{line}\..*fleet\.all_reduce")) as info:
        fleet.distributed_step(fn)(model, optimizer, *models.batches("linear", 1, 8)[0])
    assert info.value.__cause__ is None and info.value.__suppress_context__
    last = info.value.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    assert (last.tb_frame.f_code.co_filename, last.tb_lineno) == (__file__, line)
