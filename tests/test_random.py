"""Randomness (issue 33, item 1): each replica draws its own rows of the
single-device draw, so a step with dropout equals the single-device step on the
global batch, masks included, and the RNG state stays replicated.

Each script is written as Flax's guides write it -- an NNX model with
``nnx.Dropout`` fed by ``nnx.Rngs``, the Linen dropout guide's ``TrainState``
with a key and ``rngs={'dropout': fold_in(key, step)}``, a key passed to the
step -- run on one device with ``nnx.jit`` / ``jax.jit`` and on N devices with
``fleet.distributed_step``, and compared: losses, parameters, optimizer state,
RNG state. Adam's float noise is measured by the split-sum reference where it
applies (a dropout mask is per example, so the split-sum step of the same masks
is the single-device step on each replica's rows with the global mask's rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import fleet
from fleet.semantics import _random
from tests import tiers

DEVICES = tiers.replicas(1, 2, 4, 8)
STEPS, BATCH = 4, 32
TOL = 2e-6


def data(steps: int = STEPS, batch: int = BATCH, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, 6)).astype(np.float32),
             rng.integers(0, 3, batch).astype(np.int32)) for _ in range(steps)]


class DropNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def nnx_step(model, optimizer, x, y):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def nnx_run(step, model, optimizer, batches):
    return [float(step(model, optimizer, x, y)) for x, y in batches]


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(jax.random.key_data(x) if _random.is_key(x) else x)
            for x in jax.tree.leaves(tree)]


def max_diff(a, b) -> float:
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(la, lb))


@pytest.mark.parametrize("n", DEVICES)
def test_nnx_dropout_equals_one_device(make_world, n):
    batches = data()
    model = DropNet(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref = nnx_run(nnx.jit(nnx_step), model, optimizer, batches)
    ref_state = nnx.state((model, optimizer))

    make_world(n)
    model = fleet.distributed_model(DropNet(nnx.Rngs(0, dropout=1)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    got = nnx_run(fleet.distributed_step(nnx_step), model, optimizer, batches)
    state = nnx.state((model, optimizer))
    diff = max_diff(ref_state, state)
    print(f"n={n}: losses {got} vs {ref}; state max diff {diff:.2e}")
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    assert diff < 1e-5
    # the RNG state: the same key and count as one device, on every replica
    assert int(model.drop.rngs.count.get_value()) == STEPS
    assert fleet.check_replicas(state) == []


def test_nnx_dropout_masks_are_the_global_masks(make_world):
    """The bits themselves: a step returning its dropout output per example gives
    the single-device output, row for row (not only close parameters)."""
    x = np.ones((BATCH, 16), np.float32)

    def masked(drop, x):
        return drop(x)

    ref = nnx.jit(masked)(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3)), x)
    make_world(4)
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    got = fleet.distributed_step(masked)(drop, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    rows = np.asarray(got).reshape(4, BATCH // 4, 16)
    assert not all(np.array_equal(rows[0], r) for r in rows[1:])  # replicas differ


class LinenDrop(linen.Module):
    @linen.compact
    def __call__(self, x, training: bool):
        x = linen.relu(linen.Dense(16)(x))
        x = linen.Dropout(rate=0.3, deterministic=not training)(x)
        return linen.Dense(3)(x)


class KeyState(train_state.TrainState):
    key: jax.Array


def linen_step(state, batch, dropout_key):
    """Flax's dropout guide: the key folded with the step, passed as rngs."""
    dropout_train_key = jax.random.fold_in(key=dropout_key, data=state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x=batch["image"], training=True,
                                rngs={"dropout": dropout_train_key})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss


def linen_state(module):
    params_key, dropout_key = jax.random.split(jax.random.key(0))
    x = jnp.ones((1, 6))
    params = module.init(params_key, x, training=False)["params"]
    return KeyState.create(apply_fn=module.apply, params=params, tx=optax.adam(1e-2),
                           key=dropout_key)


@pytest.mark.parametrize("n", DEVICES)
def test_linen_dropout_guide_equals_one_device(make_world, n):
    batches = [{"image": x, "label": y} for x, y in data()]
    state = linen_state(LinenDrop())
    step = jax.jit(linen_step)
    ref = []
    for b in batches:
        state, loss = step(state, b, state.key)
        ref.append(float(loss))
    ref_state = state

    make_world(n)
    state = linen_state(fleet.distributed_model(LinenDrop()))
    step = fleet.distributed_step(linen_step)
    got = []
    for b in batches:
        state, loss = step(state, b, state.key)
        got.append(float(loss))
    diff = max_diff((ref_state.params, ref_state.opt_state, ref_state.key),
                    (state.params, state.opt_state, state.key))
    print(f"n={n}: losses {got} vs {ref}; state max diff {diff:.2e}")
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    assert diff < 1e-5
    assert fleet.check_replicas(state) == []


def key_arg_step(model, optimizer, x, y, key):
    """A key passed as an argument, split in the step for two draws."""
    k1, k2 = jax.random.split(key)

    def loss_fn(m):
        h = nnx.relu(m.l1(x))
        h = h * jax.random.bernoulli(k1, 0.7, h.shape) / 0.7
        noisy = h + 0.1 * jax.random.normal(k2, h.shape)
        return optax.softmax_cross_entropy_with_integer_labels(m.l2(noisy), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_key_argument_equals_one_device(make_world, n):
    batches = data()
    keys = [jax.random.fold_in(jax.random.key(7), i) for i in range(STEPS)]

    def run(step, model, optimizer):
        return [float(step(model, optimizer, x, y, k)) for (x, y), k in zip(batches, keys)]

    model = DropNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref = run(nnx.jit(key_arg_step), model, optimizer)
    ref_params = nnx.state(model, nnx.Param)
    make_world(n)
    model = fleet.distributed_model(DropNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    got = run(fleet.distributed_step(key_arg_step), model, optimizer)
    diff = max_diff(ref_params, nnx.state(model, nnx.Param))
    print(f"n={n}: losses {got} vs {ref}; parameters max diff {diff:.2e}")
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    assert diff < 1e-5


def test_a_split_key_kept_in_state_stays_replicated(make_world):
    """A TrainState-style key that the step replaces (split) leaves the step as
    the single-device key, the same on every replica."""

    def step(key, x):
        key, sub = jax.random.split(key)
        return key, x * jax.random.bernoulli(sub, 0.5, x.shape)

    x = np.ones((BATCH, 4), np.float32)
    key = jax.random.key(5)
    ref_key, ref_out = jax.jit(step)(key, x)
    make_world(4)
    got_key, got_out = fleet.distributed_step(step, batch_argnums=(1,))(key, x)
    assert jax.random.key_impl(got_key) == jax.random.key_impl(ref_key)
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(ref_key))
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(ref_out))
    assert fleet.check_replicas(got_key) == []


def test_a_draw_that_is_not_per_example_is_the_same_on_every_replica(make_world):
    """A draw whose shape does not follow the batch (a scalar mixing weight, a
    per-feature noise) is the single-device draw on every replica."""

    def step(key, x):
        lam = jax.random.uniform(key, ())
        noise = jax.random.normal(jax.random.fold_in(key, 1), (x.shape[1],))
        return (lam * x + noise).mean(), lam, noise

    x = np.random.default_rng(0).normal(size=(BATCH, 5)).astype(np.float32)
    key = jax.random.key(2)
    ref = jax.jit(step)(key, x)
    make_world(4)
    got = fleet.distributed_step(step, batch_argnums=(1,))(key, x)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("shape,offset", [((3, 5), 7), ((2, 3, 4), 2**33 + 5), ((4,), 2**64 - 9)])
def test_the_counters_are_the_global_indices(shape, offset):
    """The 64-bit counter arithmetic (no x64): the local index plus an offset, as
    the global draw's row-major index."""
    hi, lo = _random._iota(shape)
    hi, lo = _random._add((hi, lo), _random._mul(jnp.uint32(1), offset, shape))
    got = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
    want = (np.arange(np.prod(shape), dtype=np.uint64) + np.uint64(offset)).reshape(shape)
    np.testing.assert_array_equal(got, want)
    mult = _random._mul(jnp.uint32(0xFFFFFFFF), 0xFFFF_FFFF_FFFF, ())
    assert (int(mult[0]) << 32 | int(mult[1])) == (0xFFFFFFFF * 0xFFFF_FFFF_FFFF) % 2**64


def test_a_raw_key_argument_is_refused_naming_the_typed_key(make_world):
    def step(key, x):
        return x * jax.random.bernoulli(key, 0.5, x.shape)

    x = np.ones((BATCH, 3), np.float32)
    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"raw PRNG key .*jax.random.key\(seed\)"):
        fleet.distributed_step(step)(jax.random.PRNGKey(0), x)
    # as pytree state (batch_argnums), its per-example draw is refused, naming the line
    with pytest.raises(fleet.FleetError, match=r"bernoulli of shape \(8, 3\) \(.*test_random.py:"
                       r"\d+\) per example .*jax.random.key\(seed\) instead of"):
        fleet.distributed_step(step, batch_argnums=(1,))(jax.random.PRNGKey(0), x)


def test_a_key_made_inside_the_step_is_refused(make_world):
    def step(x):
        return x * jax.random.bernoulli(jax.random.key(0), 0.5, x.shape)

    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"key made inside the step"):
        fleet.distributed_step(step)(np.ones((BATCH, 3), np.float32))


def test_a_per_example_draw_needs_partitionable_threefry(make_world):
    def step(key, x):
        return x * jax.random.bernoulli(key, 0.5, x.shape)

    make_world(4)
    with jax.threefry_partitionable(False):
        with pytest.raises(fleet.FleetError, match="jax_threefry_partitionable is off"):
            fleet.distributed_step(step, batch_argnums=(1,))(
                jax.random.key(0), np.ones((BATCH, 3), np.float32))


def test_a_value_from_a_per_example_draw_alone_is_refused_where_its_type_would_lie(make_world):
    """A mask returned without touching the batch would be typed the same on every
    replica, though each replica drew its own rows: refused, naming the output.
    Through the batch (mask * x) it is per example, and gathered."""

    def bare(key, x):
        return jax.random.bernoulli(key, 0.5, x.shape).sum()

    def through(key, x):
        return (jax.random.bernoulli(key, 0.5, x.shape) * x).sum()

    x = np.ones((BATCH, 3), np.float32)
    key = jax.random.key(4)
    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"the output comes from a random draw per "
                       r"example alone"):
        fleet.distributed_step(bare, batch_argnums=(1,))(key, x)
    got = fleet.distributed_step(through, batch_argnums=(1,))(key, x)
    assert float(got) == float(jax.jit(through)(key, x))


def test_a_draw_whose_leading_axis_only_happens_to_equal_the_rows_is_refused(make_world):
    """A draw that is not per example (its shape is fixed) but whose leading axis
    equals the replica's rows: fleet could not tell it from a per-example draw."""

    def step(key, x):
        noise = jax.random.normal(key, (8, x.shape[1]))  # 8 = BATCH / 4, by chance
        return (x[:8] + noise).mean()

    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"normal of shape \(8, 3\).*not the batch on "
                       r"one device but equals this replica's batch rows"):
        fleet.distributed_step(step, batch_argnums=(1,))(jax.random.key(0),
                                                           np.ones((BATCH, 3), np.float32))


def test_an_optimizers_draw_whose_leading_axis_equals_the_rows_equals_one_device(make_world):
    """optax.noisy_sgd draws its noise in the update, from a key its state holds, in
    the parameters' shapes: a kernel of 8 inputs has a leading axis of 8, this
    replica's rows (32 / 4) by chance. An optimizer's draw is never per example:
    every replica draws the single-device noise (it was refused as ambiguous),
    NNX's nnx.Optimizer and Linen's TrainState alike."""
    batches = [(x @ np.ones((6, 8), np.float32) / 6, y) for x, y in data()]
    tx = lambda: optax.noisy_sgd(0.1, key=3)  # noqa: E731

    def linen_step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def linen_state_of(module):
        params = module.init(jax.random.key(0), batches[0][0][:1])["params"]
        return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx())

    model = nnx.Linear(8, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    ref = nnx_run(nnx.jit(nnx_step), model, optimizer, batches)
    state, step, ref_linen = linen_state_of(linen.Dense(3)), jax.jit(linen_step), []
    for x, y in batches:
        state, loss = step(state, x, y)
        ref_linen.append(float(loss))
    ref_state = state

    make_world(4)
    got_model = fleet.distributed_model(nnx.Linear(8, 3, rngs=nnx.Rngs(0)))
    got_optimizer = fleet.distributed_optimizer(nnx.Optimizer(got_model, tx(), wrt=nnx.Param))
    got = nnx_run(fleet.distributed_step(nnx_step), got_model, got_optimizer, batches)
    state, step, got_linen = linen_state_of(fleet.distributed_model(linen.Dense(3))), (
        fleet.distributed_step(linen_step)), []
    for x, y in batches:
        state, loss = step(state, x, y)
        got_linen.append(float(loss))
    diff = max_diff(nnx.state((model, optimizer)), nnx.state((got_model, got_optimizer)))
    diff_linen = max_diff((ref_state.params, ref_state.opt_state),
                          (state.params, state.opt_state))
    print(f"NNX: losses {got} vs {ref}, state {diff:.2e}; Linen: losses {got_linen} vs "
          f"{ref_linen}, state {diff_linen:.2e}")
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got_linen, ref_linen, rtol=TOL, atol=TOL)
    assert diff < 1e-6 and diff_linen < 1e-6
    key = got_optimizer.opt_state[0].rng_key[...]
    assert jnp.result_type(key) == jnp.result_type(optimizer.opt_state[0].rng_key[...])
    assert fleet.check_replicas((got_model, got_optimizer)) == []
    assert fleet.check_replicas(state) == []


class CallRngs(nnx.Module):
    """Dropout drawing from an ``nnx.Rngs`` passed at the call (Flax 0.12's
    ``Dropout(rate)(x, rngs=rngs)``), the Rngs a step argument."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.4)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def rngs_arg_step(model, optimizer, rngs, x, y):
    def loss_fn(m, rngs):
        return optax.softmax_cross_entropy_with_integer_labels(m(x, rngs), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model, rngs)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_an_rngs_argument_equals_one_device(make_world, n):
    def run(step, wrap=lambda m: m):
        model = wrap(CallRngs(nnx.Rngs(0)))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        rngs = nnx.Rngs(dropout=9)
        losses = [float(step(model, optimizer, rngs, x, y)) for x, y in data()]
        return losses, nnx.state(model, nnx.Param), rngs

    ref, ref_params, ref_rngs = run(nnx.jit(rngs_arg_step))
    make_world(n)
    got, params, rngs = run(fleet.distributed_step(rngs_arg_step), fleet.distributed_model)
    diff = max_diff(ref_params, params)
    print(f"n={n}: losses {got} vs {ref}; parameters max diff {diff:.2e}")
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    assert diff < 1e-5
    assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == STEPS
    assert fleet.check_replicas(nnx.state(rngs)) == []
