"""A loss or metric divided by the batch's mask, in its data-parallel form.

On one device a padded batch's loss is ``jnp.sum(loss * mask) / jnp.sum(mask)``. In
a fleet step each replica sees its own rows, so that ratio is the replica's own:
it is refused (``tests/test_row_mixing.py``). The form that trains as on one
device divides by the replicas' mean count, ``fleet.all_reduce(mask.sum(), 'avg')``:
each replica's value is then N times its share of the global sum over the global
count, and the replicas' mean (of the values and of the gradients) is the
single-device one. The refusal now says so.

Before, that form was refused as a summed loss ("gradients 4 times smaller"), and
a masked accuracy divided so came out 4 times the single-device value on 4
devices, silently (1.846 against 0.4615): fleet took the all-reduced count for a
constant, where it grows with the rows (``fleet.semantics._outputs_walk``,
``_OVER_REPLICAS``). A PPO step's advantages normalised by their all-reduced mean
and standard deviation train as on one device too.
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

N_TOKENS, CLASSES = 5, 4


class Tagger(nnx.Module):
    """A per-token classifier: (rows, tokens, 10) -> (rows, tokens, CLASSES)."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(10, 16, rngs=rngs)
        self.out = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def data(steps: int = 3, rows: int = 16):
    rng = np.random.RandomState(0)
    return [(rng.randn(rows, N_TOKENS, 10).astype(np.float32),
             rng.randint(0, CLASSES, (rows, N_TOKENS)).astype(np.int32),
             (rng.rand(rows, N_TOKENS) > 0.35).astype(np.float32)) for _ in range(steps)]


def token_losses(m, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y)


def masked_step(count):
    """A padded batch's step: the loss over the real tokens, and the accuracy on
    them; ``count(mask)`` is the divisor (the mask's sum on one device)."""
    def step(model, optimizer, x, y, mask):
        def loss_fn(m):
            return jnp.sum(token_losses(m, x, y) * mask) / count(mask)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        correct = (jnp.argmax(model(x), -1) == y) * mask
        return loss, jnp.sum(correct) / count(mask)
    return step


def run(step, batches, world=None):
    """The step over the batches, on one device (``world`` None: nnx.jit) or under
    fleet; the final parameters and each step's outputs."""
    model = Tagger(nnx.Rngs(0))
    if world is None:
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        call = nnx.jit(step)
    else:
        model = fleet.distributed_model(model)
        optimizer = fleet.distributed_optimizer(
            nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
        call = fleet.distributed_step(step)
    outs = [jax.tree.map(float, call(model, optimizer, *batch)) for batch in batches]
    if world is not None:
        assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    return models.flat_params(model), outs


def one_device(batches):
    return run(masked_step(jnp.sum), batches)


@pytest.mark.parametrize("n", [1, 4])
def test_a_masked_loss_over_the_mean_count_equals_one_device(make_world, n):
    batches = data()
    want, want_out = one_device(batches)
    got, got_out = run(masked_step(lambda mask: fleet.all_reduce(jnp.sum(mask), "avg")),
                       batches, make_world(n))
    d = models.max_diff(got, want)
    print(f"{n} device(s): |dparams| {d:.1e}, outputs {got_out} vs {want_out}")
    assert d < 1e-6
    # the accuracy too: before, 4 times the single-device value on 4 devices
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5)


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_a_masked_accuracy_over_an_all_reduced_count_equals_one_device(make_world, op):
    """Over the mean count, the replicas' accuracies average to the single-device
    one (before: summed, 4 times it); over the global count (all_reduce's sum)
    they sum to it, and, not differentiated, it is no summed loss."""
    def step(model, optimizer, x, y, mask):
        loss, grads = nnx.value_and_grad(lambda m: token_losses(m, x, y).mean())(model)
        optimizer.update(model, grads)
        correct = jnp.sum((jnp.argmax(model(x), -1) == y) * mask)
        return loss, correct / fleet.all_reduce(jnp.sum(mask), op)

    def reference(model, optimizer, x, y, mask):
        loss, grads = nnx.value_and_grad(lambda m: token_losses(m, x, y).mean())(model)
        optimizer.update(model, grads)
        return loss, jnp.sum((jnp.argmax(model(x), -1) == y) * mask) / jnp.sum(mask)

    batches = data(2)
    want, want_out = run(reference, batches)
    got, got_out = run(step, batches, make_world(4))
    assert models.max_diff(got, want) < 1e-6
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5)


def test_a_masked_loss_over_the_replicas_mask_is_refused_naming_the_fix(make_world):
    make_world(4)
    with pytest.raises(fleet.FleetError) as info:
        run(masked_step(jnp.sum), data(1), make_world(4))
    message = str(info.value)
    print(message)
    assert "a sum over the rows divided by another" in message
    assert "fleet.all_reduce(mask.sum(), 'avg')" in message


@pytest.mark.parametrize("count, how", [
    (lambda mask: jnp.maximum(jnp.sum(mask), 1.0), "kept from zero"),
    (lambda mask: jnp.sum(mask) + 1e-8, "plus a constant")])
def test_a_guarded_count_is_refused_naming_the_masked_mean_fix(make_world, count, how):
    """The one-device forms with a guard against an empty batch (seq2seq losses
    write ``jnp.maximum(mask.sum(), 1)``) were refused for "an elementwise max" or
    "a sum plus a constant", with the generic advice to return sums."""
    with pytest.raises(fleet.FleetError) as info:
        run(masked_step(count), data(1), make_world(4))
    message = str(info.value)
    assert f"a sum over the rows {how}" in message
    assert "Divide the masked sum by fleet.all_reduce(mask.sum(), 'avg')" in message


def test_a_masked_mean_behind_a_nan_guard_is_refused_naming_the_masked_mean(make_world):
    """optax's ranking losses take a masked mean of the lists and guard it:
    ``jnp.where(jnp.isnan(mean) & valid, 0.0, mean)``. The refusal named the
    guard ("a select_n"); it names the masked mean inside it, with its fix."""
    def step(model, optimizer, x, y, mask):
        def loss_fn(m):
            scores = m(x)[..., 0]  # (rows, tokens): each row a list to rank
            return optax.losses.ranking_softmax_loss(scores, (y > 0).astype(jnp.float32),
                                                     where=mask > 0)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(fleet.FleetError) as info:
        run(step, data(1), make_world(4))
    message = str(info.value)
    print(message)
    assert "the output (a float32 scalar" in message
    assert "a sum over the rows divided by another: a mean weighted by a mask?" in message
    assert "fleet.all_reduce(mask.sum(), 'avg')" in message


def test_a_masked_loss_over_the_global_count_is_refused_as_a_summed_loss(make_world):
    """Divided by the global count, each replica's loss is its share of the
    global one: fleet's mean of the gradients would be N times too small."""
    with pytest.raises(fleet.FleetError, match=r"gradients 4 times smaller"):
        run(masked_step(lambda mask: fleet.all_reduce(jnp.sum(mask), "sum")), data(1),
            make_world(4))


def policy_gradient_step(normalise):
    """A PPO-style step: the batch's advantages normalised by ``normalise(x)``
    (a mean), then the policy's log-probability of each taken action, picked as
    ``log_probs[jnp.arange(n), actions]``, weighted by them."""
    def step(model, optimizer, x, y, mask):
        advantages = mask[:, 0] * 3.0 + y[:, 0]
        mean = normalise(advantages.mean())
        std = jnp.sqrt(normalise(jnp.mean((advantages - mean) ** 2)))
        advantages = (advantages - mean) / (std + 1e-8)

        def loss_fn(m):
            log_probs = jax.nn.log_softmax(m(x)[:, 0])
            taken = log_probs[jnp.arange(x.shape[0]), y[:, 0]]
            return -jnp.mean(taken * advantages)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss
    return step


def test_advantages_normalised_over_the_replicas_equal_one_device(make_world):
    batches = data()
    want, want_out = run(policy_gradient_step(lambda v: v), batches)
    got, got_out = run(policy_gradient_step(lambda v: fleet.all_reduce(v, "avg")), batches,
                       make_world(4))
    d = models.max_diff(got, want)
    print(f"|dparams| {d:.1e}")
    assert d < 1e-6
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5)


def test_advantages_normalised_by_the_replicas_rows_are_refused_naming_the_fix(make_world):
    with pytest.raises(fleet.FleetError) as info:
        run(policy_gradient_step(lambda v: v), data(1), make_world(4))
    message = str(info.value)
    assert message.startswith("the step combines different rows of its batch: a value "
                              "reduced over the replica's rows")
    assert "fleet.all_reduce(x.mean(), 'avg')" in message


def test_a_load_balancing_loss_of_two_batch_means_is_refused_naming_the_product(make_world):
    """A mixture of experts' auxiliary loss, the routed fraction times the mean
    router probability per expert, is a product of two means over the replica's
    rows: no combination of the replicas' values is the single-device one. The
    reason named the ``stop_gradient`` around the fraction before."""
    def step(model, optimizer, x, y, mask):
        def loss_fn(m):
            logits = m(x)[:, 0]
            probs = jax.nn.softmax(logits)
            routed = jax.lax.stop_gradient(
                jax.nn.one_hot(jnp.argmax(probs, -1), CLASSES).mean(0))
            balance = CLASSES * jnp.sum(routed * probs.mean(0))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y[:, 0]).mean() + balance
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(fleet.FleetError, match=r"\(a mul of two values from the batch\)"):
        run(step, data(1), make_world(4))
