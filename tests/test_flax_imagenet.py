"""Flax's ImageNet example, converted the way docs/from_pmap.md says (issue 21, acceptance 3).

The original structure, on one device: a Linen ResNet whose BatchNorm layers
take ``axis_name="batch"``, a ``TrainState`` with ``batch_stats``, a warmup +
cosine learning rate read in the step, an L2 penalty computed from ``params``
inside the loss, ``lax.pmean`` of the gradients and of the metrics, and
``jax.pmap(train_step, axis_name="batch")`` over a batch reshaped to
``[devices, rows, ...]``. Its converted form (docs/from_pmap.md, "From a jax.pmap
script") runs on 4 devices through ``fleet.distributed_step`` and trains the
same model: within the float noise floor of the original itself (Flax's own
data parallelism, the original pmapped over 4 devices, and the original against
its converted form on one device), both printed. Distances are relative to each
leaf's scale, so one float32 rounding counts the same on every leaf.

Each friction point the conversion met has a test of its message or its working
here or in tests/test_batch_norm_linen.py and tests/test_step.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import fleet
from tests import tiers

STEPS, BATCH, CLASSES, WEIGHT_DECAY = 6, 32, 10, 1e-4


class ResNetBlock(nn.Module):  # Flax's examples/imagenet/models.py, smaller
    filters: int
    norm: type
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(self.norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(residual)
            residual = self.norm()(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    axis_name: str | None = "batch"  # the example's; the converted model writes fleet's

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, axis_name=self.axis_name)
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.relu(norm()(x))
        x = ResNetBlock(8, norm)(x)
        x = ResNetBlock(16, norm, strides=(2, 2))(x)
        return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class TrainState(train_state.TrainState):
    batch_stats: dict


def learning_rate_fn(base=0.1, warmup=2, total=STEPS):
    warmup_fn = optax.linear_schedule(0.0, base, warmup)
    cosine_fn = optax.cosine_decay_schedule(base, total - warmup)
    return optax.join_schedules([warmup_fn, cosine_fn], [warmup])


def cross_entropy_loss(logits, labels):
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, CLASSES)).mean()


def compute_metrics(logits, labels, axis_name=None):
    metrics = {"loss": cross_entropy_loss(logits, labels),
               "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}
    return jax.lax.pmean(metrics, axis_name) if axis_name else metrics


# -- the original: Flax's train_step, pmapped ------------------------------------------

def original_train_step(state, batch, lr_fn, axis_name="batch", l2=True):
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"],
            mutable=["batch_stats"])
        loss = cross_entropy_loss(logits, batch["label"])
        weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params) if x.ndim > 1)
        return loss + WEIGHT_DECAY * 0.5 * weight_l2 * l2, (new_model_state, logits)

    lr = lr_fn(state.step)
    (_, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    if axis_name:
        grads = jax.lax.pmean(grads, axis_name=axis_name)
    metrics = compute_metrics(logits, batch["label"], axis_name=axis_name)
    metrics["learning_rate"] = lr
    new_state = state.apply_gradients(grads=grads,
                                      batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def original_tx(lr_fn):
    return optax.sgd(lr_fn, momentum=0.9, nesterov=True)


def create_train_state(model, tx, init=None):
    variables = (init or jax.jit(model.init))(jax.random.key(0), jnp.ones((1, 16, 16, 3)))
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                             batch_stats=variables["batch_stats"])


def batches():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, (STEPS, BATCH))
    images = rng.standard_normal((STEPS, BATCH, 16, 16, 3)).astype(np.float32)
    images += labels[..., None, None, None] * 0.1  # something to learn
    return [{"image": i, "label": lbl} for i, lbl in zip(images, labels)]


def run_original(devices=1):
    """The original, as Flax runs it: ``pmap`` over ``devices`` (the global batch
    reshaped to ``[devices, rows, ...]``, the state replicated)."""
    lr_fn = learning_rate_fn()
    state = jax.tree.map(lambda a: jnp.stack([jnp.asarray(a)] * devices),
                         create_train_state(ResNet(), original_tx(lr_fn)))  # replicate
    step = jax.pmap(functools.partial(original_train_step, lr_fn=lr_fn), axis_name="batch",
                    devices=jax.devices()[:devices])
    history = []
    for batch in batches():
        shard = lambda a: a.reshape(devices, -1, *a.shape[1:])  # noqa: E731
        state, metrics = step(state, jax.tree.map(shard, batch))
        history.append({k: float(v[0]) for k, v in metrics.items()})
    return jax.tree.map(lambda a: a[0], state), history


# -- converted (docs/from_pmap.md) --------------------------------------

def train_step(state, batch, lr_fn):
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"],
            mutable=["batch_stats"])
        return cross_entropy_loss(logits, batch["label"]), (new_model_state, logits)

    lr = lr_fn(state.step)
    (_, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr
    new_state = state.apply_gradients(grads=grads,
                                      batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def converted_tx(lr_fn):
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.add_decayed_weights(WEIGHT_DECAY, mask=decay_mask),
                       original_tx(lr_fn))


def run_converted(model, step_of):
    lr_fn = learning_rate_fn()
    state = create_train_state(model, converted_tx(lr_fn))
    step = step_of(functools.partial(train_step, lr_fn=lr_fn))
    history = []
    for batch in batches():
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def distance(a, b) -> float:
    """The largest difference over parameters, running statistics and metrics, each
    leaf's relative to its own scale (its largest magnitude, at least 1): one
    float32 rounding is then about 1e-7 on every leaf, large or small."""
    def leaf(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(y)))))

    trees = [((s.params, s.batch_stats), h) for s, h in (a, b)]
    return max(jax.tree.leaves(jax.tree.map(leaf, *trees)))


@tiers.slow  # about 30 s: five runs of a ResNet
@pytest.mark.timeout(300)
def test_converted_imagenet_step_equals_the_original_on_one_device(make_world):
    original, flax_pmap = run_original(), run_original(devices=4)
    converted_one = run_converted(ResNet(axis_name=None), jax.jit)

    make_world(4)
    model = fleet.distributed_model(ResNet(axis_name=fleet.DATA_AXIS))
    fleet_run = run_converted(model, fleet.distributed_step)

    floor = max(distance(original, flax_pmap), distance(original, converted_one))
    d_fleet = distance(original, fleet_run)
    print(f"Flax ImageNet-style step, {STEPS} steps (warmup + cosine, nesterov SGD, "
          f"synced BatchNorm): converted on 4 devices against the original on one: "
          f"{d_fleet:.1e}; noise floor (the original pmapped over 4 devices, and converted "
          f"on one device): {floor:.1e}")
    assert d_fleet <= floor
    assert [h["learning_rate"] for h in fleet_run[1]] == [h["learning_rate"]
                                                         for h in original[1]]
    assert fleet.check_replicas((fleet_run[0].params, fleet_run[0].batch_stats)) == []


PARTLY_CONVERTED = {  # what is left of the original -> what the first call says
    "BatchNorm axis_name='batch'": (
        "batch", {}, r"the Linen BatchNorm 'BatchNorm_0' has axis_name='batch', which is "
                     r"not an axis of fleet's step .*axis_name=fleet\.DATA_AXIS"),
    "lax.pmean over 'batch'": (
        fleet.DATA_AXIS, {}, r"a collective over an axis other than fleet's 'data': jax\.lax"
                             r"\.pmean\(\.\.\., axis_name='batch'\) at .*test_flax_imagenet\.py"),
    "L2 penalty from params in the loss": (
        fleet.DATA_AXIS, {"axis_name": None},
        r"differentiates .*Conv_0.*kernel.* through a read outside the wrapped model's call.*"
        r"optax\.add_decayed_weights"),
}


@tiers.slow  # a trace of the ResNet each
@pytest.mark.timeout(120)
@pytest.mark.parametrize("left", list(PARTLY_CONVERTED))
def test_each_step_of_the_conversion_left_out_is_named(make_world, left):
    """The original train_step under fleet with one more step of docs/from_pmap.md's list
    done each time: the first call names what is left and what to write."""
    axis_name, kwargs, message = PARTLY_CONVERTED[left]
    make_world(4)
    lr_fn = learning_rate_fn()
    model = fleet.distributed_model(ResNet(axis_name=axis_name))
    state = create_train_state(model, original_tx(lr_fn))
    step = fleet.distributed_step(functools.partial(original_train_step, lr_fn=lr_fn, **kwargs))
    with pytest.raises(fleet.FleetError, match=message):
        step(state, batches()[0])
