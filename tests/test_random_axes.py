"""Draws fleet cannot give each replica its rows of (``fleet.semantics._random_guards.
check_batch_axes``): a draw whose batch axis is not its leading one, and a key
split into one per example.

fleet gives each replica its rows of the single-device draw where the draw's
leading axis is the batch rows (``fleet.semantics._random``). A dropout of a
transposed activation (``x.T``, features first), noise drawn time-major
(``(T, B, D)``), a draw of twice the rows (``(2 * x.shape[0], d)``), or
per-example keys (``jax.random.split(key, x.shape[0])``, ``rngs.fork(split=...)``)
drew the same bits on every replica and trained silently away from one device
(4 CPU devices, 3 SGD steps: 0.32 in the parameters for the dropout of ``x.T``,
0.017 for time-major noise, 0.046 for twice the rows, 0.051 and 0.039 for split
and forked keys). Each is now refused at the first call, naming
the line; the same draws with the batch first train as on one device.
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

import fleet
from tests import models


class Noisy(nnx.Module):
    """A linear layer on its input with dropout or noise drawn in the ``form`` given."""

    def __init__(self, form: str, rngs: nnx.Rngs):
        self.form = form
        self.linear = nnx.Linear(10, 1, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        if self.form == "dropout of x.T":
            x = self.drop(x.T).T
        elif self.form == "time-major noise":
            x = x + 0.3 * jax.random.normal(self.rngs.noise(), (2, *x.shape)).mean(0)
            x = x + 0.3 * jax.random.normal(self.rngs.noise(), (2, x.shape[0], 10))[1]
            x = x + 0.3 * jax.random.normal(self.rngs.noise(), (10, x.shape[0])).T
        elif self.form == "twice the rows":
            x = x + 0.3 * jax.random.normal(self.rngs.noise(), (2 * x.shape[0], 10))[::2]
        elif self.form == "split keys":
            keys = jax.random.split(self.rngs.noise(), x.shape[0])
            x = x + 0.3 * jax.vmap(lambda k: jax.random.normal(k, (10,)))(keys)
        elif self.form == "batch first":
            x = self.drop(x) + 0.3 * jax.random.normal(self.rngs.noise(), x.shape)
        return self.linear(x)


def make(form: str) -> Noisy:
    return Noisy(form, nnx.Rngs(0, dropout=1, noise=2))


# form: the error
REFUSED = {
    "dropout of x.T": r"draws jax.random.bernoulli of shape \(10, 16\) .*test_random_axes.py"
                      r":\d+\), whose axis 1 grows with the batch",
    "time-major noise": r"draws jax.random.normal of shape \(2, 16, 10\) .*whose axis 1 "
                        r"grows with the batch",
    "twice the rows": r"draws jax.random.normal of shape \(32, 10\) .*whose axis 0 grows "
                      r"with the batch, not as the leading axis of the batch rows",
    "split keys": r"splits a key into one per example \(16 keys at .*test_random_axes.py",
}


@pytest.mark.parametrize("form", list(REFUSED))
def test_a_draw_whose_batch_axis_is_not_leading_is_refused(make_world, form):
    make_world(4)
    with pytest.raises(fleet.FleetError, match=REFUSED[form]):
        models.train(make(form), models.batches("linear", 1, 16), wrap=True)


def test_the_same_draws_with_the_batch_first_train_as_on_one_device(make_world):
    data = models.batches("linear", 3, 16)
    want, want_losses = models.train(make("batch first"), data, wrap=False)
    make_world(4)
    got, losses = models.train(make("batch first"), data, wrap=True)
    d = models.max_diff(models.flat_params(got), models.flat_params(want))
    print(f"batch first: {d:.1e} in the parameters")
    assert d < 1e-6
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-6
    assert fleet.check_replicas(got) == []


def test_a_draw_whose_other_axis_equals_the_batch_is_not_refused(make_world):
    """A hidden width equal to the global batch (16): only an axis the replica's
    trace has shorter is the batch's."""
    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(10, 16, rngs=rngs)
            self.out = nnx.Linear(16, 1, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(nnx.relu(self.linear(x))))

    data = models.batches("linear", 2, 16)
    want, _ = models.train(Wide(nnx.Rngs(0, dropout=1)), data, wrap=False)
    make_world(4)
    got, _ = models.train(Wide(nnx.Rngs(0, dropout=1)), data, wrap=True)
    assert models.max_diff(models.flat_params(got), models.flat_params(want)) < 1e-6

