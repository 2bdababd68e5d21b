"""Loops over micro-batches (``fleet.semantics._row_blocks``).

``x.reshape(k, -1, ...)`` makes ``k`` blocks of consecutive rows: on one device
of the global batch's, inside a fleet step of the replica's own. A scan over the
blocks that sums their gradients and updates once after it is exact; one that
carries into its next iteration what it reduced over the replicas from a block
(an update per micro-batch, a decayed sum of the gradients) trained silently
away from one device (4 CPU devices, 3 steps: 0.17 in the parameters with an
``nnx.scan`` of SGD updates, 0.078 with a functional ``jax.lax.scan`` of them,
0.16 with a decayed sum under Adam). Each is now refused at the first call,
naming the scan and what to write instead: every k-th row
(``x.reshape(-1, k, ...).swapaxes(0, 1)``), whose block i is the same rows on
one device and on the replicas together, which trains as on one device. A
scan's stacked per-block losses averaged (``losses.mean()``) are the step's loss,
as on one device (refused before as "a value stacked by a scan").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fleet
from tests import models
from tests.test_row_mixing import Encoder


def _loss(m, x, y):
    return jnp.mean((m(x) - y[:, :8]) ** 2)


def _blocks(x, y):  # two blocks of consecutive rows: the global batch's on one device
    return x.reshape(2, -1, x.shape[1]), y.reshape(2, -1, y.shape[1])


def _strided(x, y):  # every other row: the same two blocks on one device and on N
    return (x.reshape(-1, 2, x.shape[1]).swapaxes(0, 1),
            y.reshape(-1, 2, y.shape[1]).swapaxes(0, 1))


def _nnx_scan_updates(split):
    def step(model, optimizer, x, y):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def each(carry, xy):
            m, opt = carry
            opt.update(m, nnx.grad(_loss)(m, *xy))
            return m, opt

        each((model, optimizer), split(x, y))
        return _loss(model, x, y)
    return step


def _lax_scan_updates(split):
    """The functional form: parameters and an SGD state carried by jax.lax.scan."""
    def step(model, optimizer, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.sgd(0.1)

        def each(carry, xy):
            p, state = carry
            grads = jax.grad(lambda p: _loss(nnx.merge(graphdef, p, rest), *xy))(p)
            updates, state = tx.update(grads, state, p)
            return (optax.apply_updates(p, updates), state), None

        (params, _), _ = jax.lax.scan(each, (params, tx.init(params)), split(x, y))
        nnx.update(model, params)
        return _loss(model, x, y)
    return step


def _summed(decay):
    """The blocks' gradients summed over a scan (``decay`` times the sum so far),
    one update after it."""
    def step(model, optimizer, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def each(acc, xy):
            grads = jax.grad(lambda p: _loss(nnx.merge(graphdef, p, rest), *xy))(params)
            return jax.tree.map(lambda a, g: (a if decay == 1 else decay * a) + g / 2,
                                acc, grads), None

        grads, _ = jax.lax.scan(each, jax.tree.map(jnp.zeros_like, params), _blocks(x, y))
        optimizer.update(model, grads)
        return _loss(model, x, y)
    return step


def _losses_averaged(split, carried=False):
    """The blocks' gradients summed over a scan, one update, and the step's loss
    the mean of the scan's stacked per-block losses (``carried``: each block's
    loss added to a running total first, a value read from the carry)."""
    def step(model, optimizer, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def each(carry, xy):
            acc, total = carry
            loss, grads = jax.value_and_grad(
                lambda p: _loss(nnx.merge(graphdef, p, rest), *xy))(params)
            total = total + loss if carried else total
            return (jax.tree.map(lambda a, g: a + g / 2, acc, grads), total), (
                total if carried else loss)

        start = (jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(x, shape=()))
        (grads, _), losses = jax.lax.scan(each, start, split(x, y))
        optimizer.update(model, grads)
        return losses.mean()
    return step


def _python_loop_updates(model, optimizer, x, y):
    for xs, ys in zip(*_strided(x, y)):
        optimizer.update(model, nnx.grad(_loss)(model, xs, ys))
    return _loss(model, x, y)


# name: the step
CARRIED = {
    "an nnx.scan of optimizer updates": _nnx_scan_updates(_blocks),
    "a jax.lax.scan of optax updates": _lax_scan_updates(_blocks),
    "a decayed sum of the gradients": _summed(0.5),
}
EXACT = {
    "every other row, an nnx.scan of optimizer updates": _nnx_scan_updates(_strided),
    "every other row, a jax.lax.scan of optax updates": _lax_scan_updates(_strided),
    "every other row, a Python loop of optimizer updates": _python_loop_updates,
    "the blocks' gradients summed, one update": _summed(1),
    "the blocks' losses stacked and averaged": _losses_averaged(_blocks),
    "every other row's losses stacked and averaged": _losses_averaged(_strided),
}


@pytest.mark.parametrize("name", list(CARRIED))
def test_a_scan_over_blocks_that_carries_what_it_reduced_is_refused(make_world, name):
    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"a scan over blocks of the rows .*x.reshape\(-1, "
                                               r"k, ...\).swapaxes\(0, 1\).*test_block_scans.py"):
        models.train(Encoder(nnx.Rngs(0)), models.batches("linear", 1, 16), wrap=True,
                     step=CARRIED[name])


def test_a_stacked_loss_read_from_the_carry_is_refused(make_world):
    """Each block's running total, stacked and averaged: the blocks' losses
    weighted by their place, which differs on a replica (its blocks are of its own
    rows); refused for what it is, where the plain average above is exact."""
    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"a value stacked by a scan, computed from its "
                                               r"carry"):
        models.train(Encoder(nnx.Rngs(0)), models.batches("linear", 1, 16), wrap=True,
                     step=_losses_averaged(_blocks, carried=True))


@pytest.mark.parametrize("name", list(EXACT))
def test_every_kth_row_and_summed_blocks_train_as_on_one_device(make_world, name):
    data = models.batches("linear", 3, 16)
    want, want_losses = models.train(Encoder(nnx.Rngs(0)), data, wrap=False, step=EXACT[name],
                                     tx=optax.adam(0.05))
    make_world(4)
    got, losses = models.train(Encoder(nnx.Rngs(0)), data, wrap=True, step=EXACT[name],
                               tx=optax.adam(0.05))
    d = models.max_diff(models.flat_params(got), models.flat_params(want))
    print(f"{name}: {d:.1e} in the parameters, losses {losses} vs {want_losses}")
    assert d < 1e-5
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-5
    assert fleet.check_replicas(got) == []
