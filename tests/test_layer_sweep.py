"""Flax NNX's layers, each in a small model as a single-device script writes it,
against fleet.

Each model trains for four steps of a new batch each (``nnx.value_and_grad``,
SGD: Adam would turn the float noise of a gradient that is zero in exact
arithmetic, such as a bias ahead of a BatchNorm or attention's key bias, into
whole steps) on one device (``nnx.jit``), then with fleet on 4 devices
(``strategy.sync_batch_norm``, so that BatchNorm's statistics are the global
batch's). Every variable of the model (parameters, running statistics, the
dropout streams' counts) and the losses must equal one device's; the draws of
dropout are the single-device step's (fleet.semantics._random). Four rows run in
the slow tier, the others extended.

Elsewhere: ``nnx.RNN`` and Linen's ``nn.RNN`` (tests/test_flax_rnn.py: their carry
needs the ``initial_carry`` the refusal names), ``nnx.scan`` over layers
(tests/test_scan.py), ``nnx.SpectralNorm`` and ``nnx.WeightNorm``
(tests/test_written_params.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers

WIDTH, CLASSES = 8, 4


class Reshaped(nnx.Module):
    """``layer`` applied to the rows as ``(rows, *shape)``, then a linear head."""

    def __init__(self, layer, shape: tuple, features: int, rngs: nnx.Rngs):
        self.layer, self.shape = layer, shape
        self.head = nnx.Linear(features, CLASSES, rngs=rngs)

    def __call__(self, x):
        out = self.layer(x.reshape(x.shape[0], *self.shape))
        return self.head(out.reshape(x.shape[0], -1))


class Attention(nnx.Module):
    """Self-attention over 4 tokens of 2 features, with dropout on its weights."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention = nnx.MultiHeadAttention(2, 2, dropout_rate=0.2, decode=False,
                                                rngs=rngs)
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x):
        tokens = x.reshape(x.shape[0], 4, 2)
        return self.head(self.attention(tokens, deterministic=False).reshape(x.shape[0], -1))


class Embedded(nnx.Module):
    """A token id made from each row, embedded."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(20, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.head(self.embed((jnp.abs(x[:, 0]) * 5).astype(jnp.int32) % 20))


def hidden(layer) -> callable:
    """A linear layer to 16 features, ``layer`` of it, a linear head."""
    return lambda rngs: nnx.Sequential(nnx.Linear(WIDTH, 16, rngs=rngs), layer(rngs),
                                       nnx.relu, nnx.Linear(16, CLASSES, rngs=rngs))


LAYERS = {
    "BatchNorm": hidden(lambda rngs: nnx.BatchNorm(16, rngs=rngs)),
    "GroupNorm": hidden(lambda rngs: nnx.GroupNorm(16, num_groups=4, rngs=rngs)),
    "RMSNorm": hidden(lambda rngs: nnx.RMSNorm(16, rngs=rngs)),
    "LayerNorm": hidden(lambda rngs: nnx.LayerNorm(16, rngs=rngs)),
    "Dropout": hidden(lambda rngs: nnx.Dropout(0.3, rngs=rngs)),
    "InstanceNorm": lambda rngs: Reshaped(nnx.InstanceNorm(2, rngs=rngs), (4, 2), WIDTH, rngs),
    "Conv 1-D": lambda rngs: Reshaped(nnx.Conv(1, 3, (3,), rngs=rngs), (WIDTH, 1), 24, rngs),
    "ConvTranspose": lambda rngs: Reshaped(nnx.ConvTranspose(1, 2, (3,), rngs=rngs),
                                           (WIDTH, 1), 16, rngs),
    "LoRALinear": lambda rngs: nnx.Sequential(
        nnx.LoRALinear(WIDTH, 16, lora_rank=2, rngs=rngs), nnx.Linear(16, CLASSES, rngs=rngs)),
    "Einsum": lambda rngs: nnx.Einsum("bi,io->bo", (WIDTH, CLASSES), (CLASSES,), rngs=rngs),
    "MultiHeadAttention, dropout": Attention,
    "Embed": Embedded,
}
SLOW_ROWS = ("GroupNorm", "ConvTranspose", "LoRALinear", "MultiHeadAttention, dropout")


def run(name: str, data, distributed: bool):
    model, optimizer = models.model_and_optimizer(LAYERS[name](nnx.Rngs(0)), optax.sgd(0.1),
                                                  wrap=distributed)

    def step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = models.run_steps(step, model, optimizer, data, distributed)
    return losses, models.flat_state(nnx.state(model))


@pytest.mark.parametrize("name", [
    pytest.param(k, marks=tiers.slow if k in SLOW_ROWS else tiers.extended) for k in LAYERS])
def test_the_layer_equals_one_device(make_world, name):
    rng = np.random.RandomState(0)
    data = [(rng.randn(16, WIDTH).astype(np.float32),
             rng.randint(0, CLASSES, 16).astype(np.int32)) for _ in range(4)]
    ref = run(name, data, distributed=False)
    strategy = fleet.DistributedStrategy()
    strategy.sync_batch_norm = True
    make_world(4, strategy)
    got = run(name, data, distributed=True)
    d_state = models.max_diff(ref[1], got[1])
    moved = models.max_diff(ref[1], models.flat_state(nnx.state(LAYERS[name](nnx.Rngs(0)))))
    print(f"{name}: |dstate| {d_state:.1e}, moved {moved:.1e}, losses {ref[0]} vs {got[0]}")
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert moved > 1e-3 and d_state < 1e-5
