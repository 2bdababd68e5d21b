"""Flax's own recurrent layers, ``nnx.RNN`` and Linen's ``nn.RNN``, in a fleet step.

``nnx.RNN`` starts its scan's carry from its cell's ``initialize_carry``: zeros,
typed the same on every replica, that come out of the first time step different
on each. JAX refuses such a carry inside ``shard_map``, and fleet refused the
step naming the loop and the generic carry fix (``jnp.zeros_like(x, shape=())``),
which a user cannot apply inside Flax's layer. The refusal now names the layer
and the argument that takes the fix, ``initial_carry``; with it, the step trains
as on one device (where the edit changes nothing). Linen's ``nn.RNN`` alike.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import fleet
from tests import models

STEPS, FEATURES = 5, 6


class Tagger(nnx.Module):
    """An LSTM over each sequence, a label per time step."""

    def __init__(self, rngs: nnx.Rngs, carry_per_replica: bool):
        self.rnn = nnx.RNN(nnx.LSTMCell(FEATURES, 8, rngs=rngs), rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)
        self.carry_per_replica = carry_per_replica

    def __call__(self, x):
        if not self.carry_per_replica:
            return self.head(self.rnn(x))
        # the refusal's edit: the carry made from the batch
        carry = jax.tree.map(lambda c: c + jnp.zeros_like(x, shape=c.shape),
                             self.rnn.cell.initialize_carry(x[:, 0].shape, self.rnn.rngs))
        return self.head(self.rnn(x, initial_carry=carry))


def data(steps: int = 3):
    rng = np.random.RandomState(0)
    return [(rng.randn(16, STEPS, FEATURES).astype(np.float32),
             rng.randint(0, 3, (16, STEPS)).astype(np.int32)) for _ in range(steps)]


def run(batches, carry_per_replica: bool, wrap: bool):
    model, losses = models.train(Tagger(nnx.Rngs(0), carry_per_replica), batches, wrap)
    assert not wrap or fleet.check_replicas(model) == []
    return models.flat_params(nnx.state(model, nnx.Param)), losses


def test_an_rnn_as_written_on_one_device_is_refused_naming_initial_carry(make_world):
    make_world(4)
    with pytest.raises(fleet.FleetError) as info:
        run(data(1), carry_per_replica=False, wrap=True)
    message = str(info.value)
    assert "carries a value that starts the same on every replica" in message
    assert "The loop is nnx.RNN's" in message
    assert "rnn(x, initial_carry=jax.tree.map(lambda c: c + jnp.zeros_like(x, shape=c.shape)" \
        in message


@pytest.mark.parametrize("n", [1, 4])
def test_an_rnn_with_its_carry_made_from_the_batch_equals_one_device(make_world, n):
    batches = data()
    want, want_losses = run(batches, carry_per_replica=False, wrap=False)
    edited, _ = run(batches, carry_per_replica=True, wrap=False)
    assert models.max_diff(edited, want) == 0  # (the edit changes nothing on one device)
    make_world(n)
    got, got_losses = run(batches, carry_per_replica=True, wrap=True)
    d = models.max_diff(got, want)
    print(f"{n} device(s): {d:.1e} from one device")
    assert d < 1e-6
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)


class LinenTagger(nn.Module):
    carry_per_replica: bool

    @nn.compact
    def __call__(self, x):
        cell = nn.LSTMCell(8)
        if not self.carry_per_replica:
            return nn.Dense(3)(nn.RNN(cell)(x))
        carry = jax.tree.map(lambda c: c + jnp.zeros_like(x, shape=c.shape),
                             cell.initialize_carry(jax.random.key(0), x[:, 0].shape))
        return nn.Dense(3)(nn.RNN(cell)(x, initial_carry=carry))


def linen_step(state, x, y):
    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn(params, x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_linen_rnn_is_refused_naming_initial_carry_and_trains_with_it(make_world):
    batches = data()
    params = LinenTagger(False).init(jax.random.key(0), batches[0][0])

    def make_state(carry_per_replica, tx):
        return train_state.TrainState.create(
            apply_fn=LinenTagger(carry_per_replica).apply, params=params, tx=tx)

    want = make_state(False, optax.sgd(0.1))
    for x, y in batches:
        want, _ = jax.jit(linen_step)(want, x, y)
    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"The loop is Linen nn.RNN's.*initial_carry=jax"):
        fleet.distributed_step(linen_step)(
            make_state(False, fleet.distributed_optimizer(optax.sgd(0.1))), *batches[0])
    got = make_state(True, fleet.distributed_optimizer(optax.sgd(0.1)))
    step = fleet.distributed_step(linen_step)
    for x, y in batches:
        got, _ = step(got, x, y)
    assert models.max_diff(models.flat_params(got.params), models.flat_params(want.params)) < 1e-6
