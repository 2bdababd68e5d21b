"""The models the equivalence tests train, in NNX and Linen, and their single-card steps.

The single-card steps are what a researcher writes before converting: the fleet
versions reuse the very same functions, wrapped by ``fleet.distributed_step``
instead of ``nnx.jit`` / ``jax.jit``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx
from flax.training.train_state import TrainState

import fleet

LR = 1e-2


class LinearNet(nnx.Module):
    """The seeds' LinearNet: Linear(10, 10) -> Linear(10, 1)."""

    def __init__(self, rngs: nnx.Rngs):
        self._linear1 = nnx.Linear(10, 10, rngs=rngs)
        self._linear2 = nnx.Linear(10, 1, rngs=rngs)

    def __call__(self, x):
        return self._linear2(self._linear1(x))


class CNN(nnx.Module):
    """A small CNN: two 3x3 convolutions with max-pooling, then a linear classifier."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, (3, 3), rngs=rngs)
        self.linear = nnx.Linear(2 * 2 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.linear(x.reshape(x.shape[0], -1))


class LinenLinearNet(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(1)(linen.Dense(10)(x))


class LinenCNN(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.max_pool(linen.relu(linen.Conv(4, (3, 3))(x)), (2, 2), (2, 2))
        x = linen.max_pool(linen.relu(linen.Conv(8, (3, 3))(x)), (2, 2), (2, 2))
        return linen.Dense(10)(x.reshape(x.shape[0], -1))


def loss_of(outputs, y):
    if y.dtype == jnp.int32:  # classification
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()
    return ((outputs - y) ** 2).mean()  # MSE, as the seeds


def nnx_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
    optimizer.update(model, grads)
    return loss


def train(model, batches, wrap: bool, step=nnx_train_step, tx=None) -> list[float]:
    """``step`` over the batches, SGD (0.1) unless ``tx``: on one device (``nnx.jit``),
    or wrapped and stepped by fleet (``wrap``: the model wrapped first, in place of
    the one given). Returns the (wrapped) model and each step's loss."""
    tx = optax.sgd(0.1) if tx is None else tx
    if wrap:
        model = fleet.distributed_model(model)
        optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
        call = fleet.distributed_step(step)
    else:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        call = nnx.jit(step)
    return model, [float(call(model, optimizer, *b)) for b in batches]


def linen_train_step(state, x, y):
    def loss_fn(params):
        return loss_of(state.apply_fn({"params": params}, x), y)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def batches(kind: str, steps: int, batch: int, seed: int = 0):
    """``steps`` global batches for a ``linear`` (MSE) or ``cnn`` (10 classes) model."""
    rng = np.random.RandomState(seed)
    if kind == "linear":
        xs = rng.randn(steps, batch, 10).astype(np.float32)
        ys = rng.randn(steps, batch, 1).astype(np.float32)
    else:
        xs = rng.randn(steps, batch, 8, 8, 3).astype(np.float32)
        ys = rng.randint(0, 10, (steps, batch)).astype(np.int32)
    return list(zip(xs, ys))


NNX_MODELS = {"linear": LinearNet, "cnn": CNN}
LINEN_MODELS = {"linear": LinenLinearNet, "cnn": LinenCNN}


def flat_params(tree) -> dict:
    """``{path: numpy array}`` of a params pytree or an NNX module's params."""
    if isinstance(tree, nnx.Module):
        tree = nnx.to_pure_dict(nnx.state(tree, nnx.Param))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def split_mean_grad(grad_fn, x, y, n):
    """The split-sum gradient: the average of the gradients of the n sub-batches."""
    parts = [grad_fn(xs, ys) for xs, ys in zip(np.split(x, n), np.split(y, n))]
    return jax.tree.map(lambda *g: sum(g) / n, *parts)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def nnx_reference(kind: str, data, tx=None):
    """The single-card NNX script: losses per step and final parameters."""
    model = NNX_MODELS[kind](nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx or optax.adam(LR), wrt=nnx.Param)
    step = nnx.jit(nnx_train_step)
    losses = [float(step(model, optimizer, x, y)) for x, y in data]
    return losses, flat_params(model)


def one_device_and_fleet(make_model, step, data, make_world, n: int = 4):
    """``step(model, optimizer, x, y)`` over ``data`` (SGD) on one device (``nnx.jit``),
    then with fleet on ``n`` devices, each from ``make_model()``: ``(losses,
    parameters)`` of each; fleet's model and optimizer asserted the same on every
    device."""
    def run(model, wrap, distributed: bool):
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        if distributed:
            optimizer = fleet.distributed_optimizer(optimizer)
        losses = [float(wrap(step)(model, optimizer, x, y)) for x, y in data]
        if distributed:
            assert fleet.check_replicas((model, optimizer)) == []
        return losses, flat_params(model)

    want = run(make_model(), nnx.jit, False)
    make_world(n)
    return want, run(fleet.distributed_model(make_model()), fleet.distributed_step, True)


def model_and_optimizer(model, tx, wrap: bool) -> tuple:
    """``model`` and an ``nnx.Optimizer`` of ``tx`` over its parameters, both wrapped
    by fleet (``fleet.distributed_model`` / ``fleet.distributed_optimizer``) if ``wrap``."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if not wrap:
        return model, optimizer
    model = fleet.distributed_model(model)
    return model, fleet.distributed_optimizer(optimizer)


def run_steps(step, model, optimizer, data, distributed: bool) -> list[float]:
    """``step(model, optimizer, x, y)`` over ``data``: the losses, with fleet
    (``fleet.distributed_step``, the replicas then asserted the same) or ``nnx.jit``."""
    fn = fleet.distributed_step(step) if distributed else nnx.jit(step)
    losses = [float(fn(model, optimizer, x, y)) for x, y in data]
    if distributed:
        assert fleet.check_replicas((model, optimizer)) == []
    return losses


def flat_state(tree) -> dict:
    """``{path: numpy array}`` of every leaf of ``tree`` (an NNX state or a pytree),
    PRNG keys as their key data and booleans as integers (so that two compare by
    difference)."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    return {jax.tree_util.keystr(p): np.asarray(
        jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v,
        dtype=np.int32 if jnp.result_type(v) == jnp.bool_ else None)
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def linen_init(kind: str, data):
    return LINEN_MODELS[kind]().init(jax.random.key(0), data[0][0][:1])


def linen_reference(kind: str, data):
    module = LINEN_MODELS[kind]()
    params = linen_init(kind, data)["params"]
    state = TrainState.create(apply_fn=module.apply, params=params, tx=optax.adam(LR))
    step = jax.jit(linen_train_step)
    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return losses, flat_params(state.params)
