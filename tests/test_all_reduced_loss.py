"""Losses made of statistics all-reduced over the replicas, differentiated.

A mixture of experts' load-balancing loss (Switch Transformer style: the
fraction of rows routed to each expert times the router's mean probability for
it, both over the global batch).

Converted as the masked-loss fix suggests, both means all-reduced
(``fleet.all_reduce(probs.mean(0), 'avg')``), the loss adds an all-reduced value
to the replica's own: JAX sums its gradient over the replicas on top of
``fleet.all_reduce``'s global adjoint, N times the single-device gradient. It was
refused, but as "a read outside the wrapped model's call (an L2 penalty...)",
which the script has none of. It is now refused naming the line and the form
that trains as on one device: the routed fraction all-reduced, the router's mean
probability the replica's own.

Barlow Twins (two views' embeddings normalised over the batch, their
cross-correlation pushed to the identity), with the batch's mean and variance
all-reduced: the same sum, refused as "the step sums over the replicas itself
... use fleet.all_reduce", which it did. Now refused as above, naming the
normalisation's line and nnx.BatchNorm with strategy.sync_batch_norm, with which
(and the cross-correlation all-reduced) it trains as on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers

EXPERTS = 4


class MoE(nnx.Module):
    """A router over four linear experts, mixed by its probabilities."""

    def __init__(self, rngs: nnx.Rngs):
        self.router = nnx.Linear(10, EXPERTS, rngs=rngs)
        self.experts = nnx.Linear(10, EXPERTS * 3, rngs=rngs)
        self.head = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x))
        mixed = jnp.einsum("be,bed->bd", probs, self.experts(x).reshape(-1, EXPERTS, 3))
        return self.head(jax.nn.relu(mixed)), probs


def step_of(mean_of_probs):
    """The step, with the router's mean probability over the batch as given."""
    def step(model, optimizer, x, y):
        def loss_fn(m):
            pred, probs = m(x)
            frac = fleet.all_reduce(jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS).mean(0),
                                    "avg")
            aux = EXPERTS * jnp.sum(frac * mean_of_probs(probs))
            return jnp.mean((pred - y) ** 2) + 0.1 * aux  # (the line the refusal names)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss
    return step


ALL_REDUCED = step_of(lambda probs: fleet.all_reduce(probs.mean(0), "avg"))
OWN_SHARE = step_of(lambda probs: probs.mean(0))


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_an_all_reduced_mean_differentiated_in_the_loss_is_refused_naming_the_fix(make_world, n):
    """On one replica too, as fleet's other sums over the replicas: the script fails
    where it is written, not first on a cluster."""
    make_world(n)
    model = MoE(nnx.Rngs(0))
    before = models.flat_params(model)
    with pytest.raises(fleet.FleetError) as info:
        models.train(model, models.batches("linear", 1, 16), wrap=True, step=ALL_REDUCED)
    message = str(info.value)
    print(message)
    assert message.startswith("the step differentiates a value of fleet.all_reduce combined "
                              "with each replica's own values")
    assert f"{__file__}:" in message  # the loss's line
    assert "N times the single-device gradient" in message
    assert "fleet.all_reduce(frac.mean(0), 'avg') * probs.mean(0)" in message
    assert "outside the wrapped model's call" not in message  # (the reason it gave before)
    assert models.max_diff(models.flat_params(model), before) == 0  # (nothing ran)


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_the_replicas_own_share_trains_as_on_one_device(make_world, n):
    data = models.batches("linear", 3, 16)
    want, want_losses = models.train(MoE(nnx.Rngs(0)), data, wrap=False, step=OWN_SHARE)
    make_world(n)
    got, losses = models.train(MoE(nnx.Rngs(0)), data, wrap=True, step=OWN_SHARE)
    d = models.max_diff(models.flat_params(got), models.flat_params(want))
    print(f"{n} devices: parameters {d:.1e} from one device; losses {losses} / {want_losses}")
    assert d < 1e-6
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert fleet.check_replicas(got) == []



class Projector(nnx.Module):
    """An MLP projector; ``normalise``: an nnx.BatchNorm without scale or bias last."""

    def __init__(self, rngs: nnx.Rngs, normalise: bool):
        self.hidden = nnx.Linear(10, 8, rngs=rngs)
        self.out = nnx.Linear(8, 5, rngs=rngs)
        self.bn = nnx.BatchNorm(5, use_scale=False, use_bias=False, rngs=rngs) if normalise else None

    def __call__(self, x):
        z = self.out(jax.nn.relu(self.hidden(x)))
        return z if self.bn is None else self.bn(z)


def barlow_twins(normalise):
    """The step; ``normalise(z)``: the rows over their batch's statistics."""
    def step(model, optimizer, x, y):
        def loss_fn(m):
            z1, z2 = normalise(m(x)), normalise(m(x[:, ::-1] * 0.9 + 0.1))
            c = fleet.all_reduce(z1.T @ z2 / x.shape[0], "avg")
            return jnp.sum((jnp.diag(c) - 1) ** 2) + 0.005 * jnp.sum(
                (c - jnp.diag(jnp.diag(c))) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss
    return step


def all_reduced_statistics(z):
    mean = fleet.all_reduce(z.mean(0), "avg")
    var = fleet.all_reduce((z ** 2).mean(0), "avg") - mean ** 2
    return (z - mean) / jnp.sqrt(var + 1e-5)  # (the line the refusal names)


def test_rows_normalised_by_all_reduced_statistics_are_refused_naming_batch_norm(make_world):
    make_world(4)
    with pytest.raises(fleet.FleetError) as info:
        models.train(Projector(nnx.Rngs(0), normalise=False), models.batches("linear", 1, 16),
                     wrap=True, step=barlow_twins(all_reduced_statistics))
    message = str(info.value)
    print(message)
    assert message.startswith("the step differentiates a value of fleet.all_reduce combined "
                              "with each replica's own values")
    assert f"{__file__}:" in message
    assert "nnx.BatchNorm(use_scale=False, use_bias=False) with strategy.sync_batch_norm" in (
        message)
    assert "sums over the 4 replicas itself" not in message  # (the reason it gave before)


@pytest.mark.parametrize("n", tiers.replicas(1, 4))
def test_barlow_twins_with_a_synced_batch_norm_trains_as_on_one_device(make_world, n):
    data = models.batches("linear", 3, 16)
    step = barlow_twins(lambda z: z)
    want, want_losses = models.train(Projector(nnx.Rngs(0), normalise=True), data, wrap=False,
                                     step=step, tx=optax.sgd(0.01))
    strategy = fleet.DistributedStrategy()
    strategy.sync_batch_norm = True
    make_world(n, strategy)
    got, losses = models.train(Projector(nnx.Rngs(0), normalise=True), data, wrap=True,
                               step=step, tx=optax.sgd(0.01))
    d = models.max_diff(models.flat_params(got), models.flat_params(want))
    print(f"{n} devices: parameters {d:.1e} from one device; losses {losses} / {want_losses}")
    assert d < 1e-6
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert fleet.check_replicas(got) == []
