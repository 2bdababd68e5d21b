"""Steps that combine different rows of the batch (``fleet.semantics._row_mixing``).

Inside a fleet step each replica sees its own rows: mixup's shuffle, a flipped or
rolled batch, a contrastive loss's row-by-row similarities, a sort over the rows,
the batch's mean subtracted from each row and a loss divided by the batch's total
mask all see fewer rows than the single-device step, and trained silently away
from it (4 CPU devices, 3 SGD steps: 0.006 to 2.5 in the loss, 0.069 in the
parameters for the masked loss; hard-example mining with ``jax.lax.top_k`` and
class weights counted with ``jnp.bincount``, 0.049 and 0.044 in the parameters
after 4 Adam steps). Each is now refused at the first call, naming
the line, before anything runs; on one replica each equals one device. Row-wise
operations that look alike (along the features, within a row, over every row,
rows reordered alike: a GAN's real and generated rows concatenated) still train
as on one device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers


class Encoder(nnx.Module):
    """A linear embedding, normalised per row, with a random stream for mixup."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(10, 8, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        z = self.linear(x)
        return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def mixup(m, x, y):
    perm = jax.random.permutation(m.rngs.mixup(), x.shape[0])
    return jnp.mean((m(0.7 * x + 0.3 * x[perm]) - y) ** 2)


def contrastive(m, x, y):
    za, zb = m(x), m(x + 0.1)
    logits = za @ zb.T / 0.1
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.arange(x.shape[0])).mean()


@jax.jit
def centered(z):
    return z - z.mean(0)


def scanned_contrastive(m, x, y):
    """A contrastive loss after a scanned block (the walk follows scan bodies)."""
    z = jax.lax.scan(lambda h, _: (jnp.tanh(h), None), m(x), None, length=2)[0]
    return jnp.mean(z @ z.T)


def masked(m, x, y):
    mask = (y[:, 0] > 0).astype(jnp.float32)
    per_row = jnp.mean((m(x) - y) ** 2, axis=-1)
    return jnp.sum(per_row * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def labels_of(y):
    return (y[:, 0] > 0).astype(jnp.int32)


def hard_examples(m, x, y):
    """Online hard-example mining: the mean of the batch's worst half."""
    per_row = optax.softmax_cross_entropy_with_integer_labels(m(x), labels_of(y))
    return jax.lax.top_k(per_row, x.shape[0] // 2)[0].mean()


def mixup_sometimes(m, x, y):
    """Mixup applied with probability 0.8, as timm does: inside a jax.lax.cond."""
    def mix(x, y):
        return 0.7 * x + 0.3 * x[::-1], 0.7 * y + 0.3 * y[::-1]

    x, y = jax.lax.cond(jax.random.uniform(m.rngs.mixup()) < 0.8, mix, lambda x, y: (x, y), x, y)
    return jnp.mean((m(x) - y) ** 2)


def contrastive_switched_on(m, x, y):
    """A contrastive term added by a cond (on after a warm-up: here, on a weight)."""
    def term(z):
        return jnp.mean(z @ z.T)

    z = m(x)
    return jnp.mean((z - y[:, :8]) ** 2) + jax.lax.cond(
        m.linear.kernel[0, 0] > -1e9, term, lambda z: 0.0 * z.mean(), z)


def sinkhorn(z, iterations):
    """SwAV's Sinkhorn-Knopp codes, normalised over the batch's rows and the
    prototypes in turn, in a while loop (``iterations`` traced)."""
    def body(carry):
        i, q = carry
        q = q / q.sum(axis=0, keepdims=True)
        return i + 1, q / q.sum(axis=1, keepdims=True)

    q = jnp.exp(jax.lax.stop_gradient(z) / 0.5)
    return jax.lax.while_loop(lambda c: c[0] < iterations, body, (0, q))[1]


def swav(m, x, y):
    z = m(x)
    codes = sinkhorn(z, jnp.int32(3) + 0 * m.linear.bias[...].astype(jnp.int32)[0])
    return -jnp.mean(jnp.sum(codes * jax.nn.log_softmax(z / 0.1), axis=1))


def per_row_iterations(m, x, y):
    """Each row's weight refined in a while loop (a row-wise fixed point, not
    differentiated: JAX differentiates no while loop)."""
    z = m(x)
    n = jnp.int32(3) + 0 * m.linear.bias[...].astype(jnp.int32)[0]
    start = jax.lax.stop_gradient(z)
    w = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1]) + start),
                           (0, start))[1]
    return jnp.mean(jnp.abs(w) * (z - y[:, :8]) ** 2)


def class_weighted(m, x, y):
    """Each row weighted by 1 / its label's count in the batch."""
    labels = labels_of(y)
    weights = 1.0 / jnp.bincount(labels, length=2)[labels]
    return jnp.mean(weights * optax.softmax_cross_entropy_with_integer_labels(m(x), labels))


def classes_of(y):
    """Four classes: as many as each of 4 replicas' rows (of 16), by chance."""
    return jnp.clip(jnp.floor(y[:, 0] * 2 + 2), 0, 3).astype(jnp.int32)


def center_loss(m, x, y):
    """Each row pulled to its class's mean in the batch (a center loss)."""
    z, labels = m(x), classes_of(y)
    onehot = jax.nn.one_hot(labels, 4)
    means = onehot.T @ z / jnp.maximum(onehot.sum(0), 1.0)[:, None]
    return jnp.mean(jnp.sum((z - means[labels]) ** 2, -1))


def positions_added(m, x, y):
    """Four token positions' embeddings (as many as a replica's rows, by chance)
    added to every row: the positions are not rows."""
    positions = m.linear.kernel[jnp.arange(4)]
    return jnp.mean((m(x)[:, None, :] + positions[None, :, :]) ** 2)


def whitened(m, x, y):
    """The rows times their batch's second moment."""
    z = m(x)
    return jnp.mean((z @ (z.T @ z / x.shape[0])) * y[:, :8])


def batch_weighted(m, x, y, weights):
    """Each row's loss weighted by a softmax over the batch's losses, then summed."""
    per_row = jnp.mean((m(x) - y) ** 2, axis=-1)
    return jnp.sum(weights(jax.nn.softmax(per_row)) * per_row)


# name: (the loss, what the error says)
MIXING = {
    "mixup's shuffle": (mixup, r"rows picked by index \(.*jax.random.permutation\), then "
                               r"combined with the rows in another order"),
    "a flipped batch": (lambda m, x, y: jnp.mean((m(x) - m(x)[::-1]) ** 2),
                        r"the rows reversed .*, then combined with the rows in another order"),
    "a rolled batch": (lambda m, x, y: jnp.mean((m(x) - jnp.roll(m(x), 1, axis=0)) ** 2),
                       r"some of the rows taken"),
    # (exact by linearity, but fleet cannot tell a partition from a subset: the
    # message names the scan over a reshape, which trains as on one device)
    "micro-batches sliced": (
        lambda m, x, y: sum(jnp.mean((m(x[i * 2:(i + 1) * 2]) - y[i * 2:(i + 1) * 2]) ** 2)
                            for i in range(2)) / 2,
        r"some of the rows taken \(2 of 4: .*scan over x.reshape\(k, -1, ...\)"),
    "a micro-batch picked from blocks": (
        lambda m, x, y: sum(jnp.mean((m(xs) - ys) ** 2) for xs, ys in zip(
            x.reshape(2, -1, x.shape[1]), y.reshape(2, -1, y.shape[1]))) / 2,
        r"a block of the rows picked \(x.reshape\(k, -1, ...\)\[i\]"),
    "a contrastive loss": (contrastive, r"a product of every row with every row"),
    "a sort over the rows": (
        lambda m, x, y: jnp.mean(jnp.sort(m(x)[:, 0]) * jnp.arange(x.shape[0])),
        r"the rows reordered by a sort over them"),
    "the batch mean subtracted": (
        lambda m, x, y: jnp.mean((m(x) - m(x).mean(0)) ** 2 * y),
        r"a value reduced over the replica's rows .* combined with the rows themselves"),
    "the batch mean subtracted in a jitted helper": (
        lambda m, x, y: jnp.mean(centered(m(x)) ** 2 * y),
        r"a value reduced over the replica's rows .* combined with the rows themselves"),
    "a contrastive loss after a scan": (
        scanned_contrastive, r"a product of every row with every row"),
    "a loss divided by the batch's mask": (
        masked, r"a value reduced over the replica's rows .* combined with the rows themselves"),
    # (the rows' tags pass take_along_axis, as optax's cross-entropy picks each row's label)
    "hard examples by top_k": (hard_examples, r"the top rows picked"),
    "class weights counted in the batch": (
        class_weighted, r"a value reduced over the replica's rows \(.*count over the batch\) "
                        r"combined with the rows themselves"),
    "the rows times the batch's second moment": (
        whitened, r"a value reduced over the replica's rows .* combined with the rows themselves"),
    # (was silent where the loss is only differentiated: 0.039 after 3 SGD steps)
    "pairs of rows by broadcasting": (
        lambda m, x, y: jnp.mean(jnp.sum((m(x)[:, None] - m(x)[None, :]) ** 2, -1)),
        r"every row paired with every row \(z\[:, None\] - z\[None, :\]"),
    # (was silent with as many classes as a replica's rows: 0.027 after 3 SGD steps;
    # jax.nn.one_hot's class index looked like the rows' own)
    "a center loss with as many classes as rows": (
        center_loss, r"a value reduced over the replica's rows .* combined with the rows "
                     r"themselves"),
    # (was silent: 0.063 in the parameters after 4 Adam steps)
    "rows picked by labels": (
        lambda m, x, y: jnp.mean((m(x)[labels_of(y)] - m(x)) ** 2),
        r"rows picked by indices that come from the batch"),
    # (each was silent: 0.025 (convolution), 0.009 (pooling), 0.082 (Fourier), 0.022
    # (svd), 0.038 (log-determinant) in the parameters after 3 SGD steps)
    # (silent: the walk did not follow a cond's branches; 0.031 and 0.035 after 3 steps)
    "mixup applied with some probability": (
        mixup_sometimes, r"the rows reversed .*, then combined with the rows in another order"),
    "a contrastive term in a cond": (contrastive_switched_on,
                                     r"a product of every row with every row"),
    # (silent: the walk did not follow a while_loop)
    "Sinkhorn codes over the batch in a while loop": (
        swav, r"a value reduced over the replica's rows .* combined with the rows themselves"),
    "a convolution over the rows": (
        lambda m, x, y: jnp.mean(jnp.convolve(m(x)[:, 0], jnp.ones(3) / 3, mode="same") ** 2),
        r"a convolution sliding over the rows"),
    "pooling over the rows": (
        lambda m, x, y: jnp.mean(nnx.avg_pool(m(x)[None], (3,), strides=(1,),
                                              padding="SAME") ** 2),
        r"a pooling window sliding over the rows"),
    "a Fourier transform over the rows": (
        lambda m, x, y: jnp.mean(jnp.abs(jnp.fft.fft(m(x)[:, 0]))),
        r"a Fourier transform over the rows"),
    "an svd of the rows": (
        lambda m, x, y: jnp.linalg.svd(m(x), compute_uv=False)[0],
        r"a matrix decomposition of the rows \(svd"),
    # (were refused as a summed loss, whose suggested mean is refused for the mixing)
    "a softmax over the batch's losses, summed": (
        lambda m, x, y: batch_weighted(m, x, y, lambda w: w),
        r"a value reduced over the replica's rows .* combined with the rows themselves"),
    "weights from a softmax over the batch, not differentiated, summed": (
        lambda m, x, y: batch_weighted(m, x, y, jax.lax.stop_gradient),
        r"a value reduced over the replica's rows .* combined with the rows themselves"),
    "the log-determinant of the batch's covariance": (
        lambda m, x, y: jnp.linalg.slogdet(m(x).T @ m(x) / x.shape[0] + jnp.eye(8))[1],
        r"a value reduced over the replica's rows .* combined with the rows themselves"),
}


def step_of(loss_fn):
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: loss_fn(m, x, y))(model)
        optimizer.update(model, grads)
    return step


def one_device(loss_fn, data) -> dict:
    model = Encoder(nnx.Rngs(0, mixup=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(step_of(loss_fn))
    for x, y in data:
        step(model, optimizer, x, y)
    return models.flat_params(model)


def with_fleet(loss_fn, data, make_world, n: int, model=None):
    make_world(n)
    model = fleet.distributed_model(model or Encoder(nnx.Rngs(0, mixup=1)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(step_of(loss_fn))
    for x, y in data:
        step(model, optimizer, x, y)
    return model


@pytest.mark.parametrize("name", MIXING)
def test_a_step_that_mixes_rows_is_refused_naming_the_line(make_world, name):
    loss_fn, what = MIXING[name]
    before = one_device(loss_fn, [])
    model = Encoder(nnx.Rngs(0, mixup=1))
    with pytest.raises(fleet.FleetError) as info:
        with_fleet(loss_fn, models.batches("linear", 1, 16), make_world, 4, model)
    message = str(info.value)
    print(message)
    assert message.startswith("the step combines different rows of its batch: ")
    assert __file__ in message  # the line of the loss
    assert "each replica computes on its own 4 rows" in message
    assert re.search(what, message)
    assert models.max_diff(models.flat_params(model), before) == 0  # (nothing ran before)


@pytest.mark.parametrize("name", [  # (one replica: the first row; the others extended, as replicas())
    name if i == 0 else pytest.param(name, marks=tiers.extended) for i, name in enumerate(MIXING)])
def test_on_one_replica_a_step_that_mixes_rows_equals_one_device(make_world, name):
    loss_fn, _ = MIXING[name]
    data = models.batches("linear", 2, 16)
    got = with_fleet(loss_fn, data, make_world, 1)
    assert models.max_diff(models.flat_params(got), one_device(loss_fn, data)) < 1e-6


def test_a_returned_loss_weighted_by_a_softmax_over_the_batch_is_refused_for_the_mixing(
        make_world):
    """Summed and returned: refused for the rows it mixes, not as a summed loss
    (whose suggested mean would be refused next)."""
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: batch_weighted(m, x, y, lambda w: w))(model)
        optimizer.update(model, grads)
        return loss

    make_world(4)
    model = fleet.distributed_model(Encoder(nnx.Rngs(0, mixup=1)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match="the step combines different rows of its batch: "
                                               "a value reduced over the replica's rows"):
        fleet.distributed_step(step)(model, optimizer, *models.batches("linear", 1, 16)[0])


#: Row-wise operations that look like the ones above
ROW_WISE = {
    "features reversed": lambda m, x, y: jnp.mean((m(x)[:, ::-1] - y) ** 2),
    "sorted within each row": lambda m, x, y: jnp.mean(jnp.sort(m(x), axis=1) * y),
    "each row's own mean subtracted": lambda m, x, y: jnp.mean(
        (m(x) - m(x).mean(1, keepdims=True)) ** 2),
    "an outer product within each row": lambda m, x, y: jnp.mean(
        jnp.einsum("bi,bj->bij", m(x), m(x)) * y[:, :, None]),
    "labels picked per row": lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(
        m(x), (y[:, 0] > 0).astype(jnp.int32)).mean(),
    "every row's slice": lambda m, x, y: jnp.mean((m(x)[: x.shape[0]] - y) ** 2),
    # reordering alone: a mean sees the same rows (a GAN's real and generated rows)
    "two batches concatenated": lambda m, x, y: jnp.mean(
        (m(jnp.concatenate([x, 0.5 * x])) - jnp.concatenate([y, -y])) ** 2),
    "the rows reversed alone": lambda m, x, y: jnp.mean((m(x[::-1]) - y[::-1]) ** 2),
    # a table's row per batch row (an embedding); its gradient adds the rows into the table
    "a parameter row looked up per row": lambda m, x, y: jnp.mean(
        (m(x) + m.linear.kernel[labels_of(y)]) ** 2),
    # (its gradient is a scatter of each row into its own row: was refused)
    "each row's label picked by jnp.arange": lambda m, x, y: -jnp.mean(
        jax.nn.log_softmax(m(x))[jnp.arange(x.shape[0]), labels_of(y)]),
    # an index as long as a replica's rows that is not over the rows: token positions,
    # a one-hot over as many classes (a triplet's refusal took the first for rows)
    "positions as many as the rows": positions_added,
    "one-hot labels over as many classes as rows": lambda m, x, y: jnp.mean(
        optax.softmax_cross_entropy(m(x)[:, :4], jax.nn.one_hot(classes_of(y), 4))),
    "a constant weight per label": lambda m, x, y: jnp.mean(
        jnp.array([1.0, 3.0])[labels_of(y)]
        * optax.softmax_cross_entropy_with_integer_labels(m(x), labels_of(y))),
    # pooling, Fourier transforms and decompositions within each row, or of the weights
    "pooling along each row's features": lambda m, x, y: jnp.mean(
        nnx.avg_pool(m(x)[:, :, None], (3,), strides=(1,), padding="SAME")[..., 0] * y),
    "a Fourier transform of each row": lambda m, x, y: jnp.mean(
        jnp.abs(jnp.fft.rfft(m(x), axis=-1)) * y[:, :5]),
    "a log-determinant per row": lambda m, x, y: jnp.mean(jnp.linalg.slogdet(
        jnp.eye(8) + jnp.einsum("bi,bj->bij", m(x), m(x)))[1]),
    "a row-wise while loop": per_row_iterations,
    "a row-wise branch": lambda m, x, y: jnp.mean((jax.lax.cond(
        m.linear.kernel[0, 0] > 0, lambda z: 2 * z, lambda z: z - 1, m(x)) - y[:, :8]) ** 2),
    "the weights' largest singular value": lambda m, x, y: jnp.mean((m(x) - y) ** 2) + 0.1 * (
        jnp.linalg.svd(m.linear.kernel[...], compute_uv=False)[0]),
}


@pytest.mark.parametrize("name", ROW_WISE)
def test_row_wise_steps_that_look_alike_train_as_on_one_device(make_world, name):
    data = models.batches("linear", 2, 16)
    got = with_fleet(ROW_WISE[name], data, make_world, 4)
    want = one_device(ROW_WISE[name], data)
    d = models.max_diff(models.flat_params(got), want)
    print(f"{name}: {d:.1e} from one device")
    assert d < 1e-6
    assert fleet.check_replicas(got) == []



def gated_step(decide, form: str):
    """A step that skips the update on a loss spike, where ``decide(loss)`` is false:
    its gradients zeroed (``where``) or the update not taken (``cond``)."""
    def apply(optimizer, model, grads):
        optimizer.update(model, grads)

    def skip(optimizer, model, grads):
        pass

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        ok = decide(loss)
        if form == "where":
            apply(optimizer, model, jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads))
        else:
            nnx.cond(ok, apply, skip, optimizer, model, grads)
        return loss
    return step


LIMIT = 1.2  # (between the batches' losses below: the gate skips some steps, not all)


@pytest.mark.parametrize("form", ["where", "cond"])
def test_a_decision_on_the_replicas_own_loss_applied_to_the_gradients_is_refused(make_world,
                                                                                  form):
    # (was silent, 4 SGD steps: where 0.14 in the parameters, every replica alike; cond
    # 0.13, and the replicas' parameters differed)
    make_world(4)
    model = fleet.distributed_model(Encoder(nnx.Rngs(0, mixup=1)))
    before = models.flat_params(model)
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(gated_step(lambda loss: loss < LIMIT, form))
    with pytest.raises(fleet.FleetError) as info:
        step(model, optimizer, *models.batches("linear", 1, 16)[0])
    message = str(info.value)
    print(message)
    assert "a decision made from a value reduced over the replica's rows" in message
    assert f"{__file__}:" in message
    assert "fleet.all_reduce(loss, 'avg') < limit" in message
    assert models.max_diff(models.flat_params(model), before) == 0  # (nothing ran)


@pytest.mark.parametrize("form", ["where", "cond"])
def test_a_decision_on_the_all_reduced_loss_trains_as_on_one_device(make_world, form):
    data = models.batches("linear", 4, 16)
    step = gated_step(lambda loss: fleet.all_reduce(loss, "avg") < LIMIT, form)
    want, want_losses = models.train(Encoder(nnx.Rngs(0, mixup=1)), data, wrap=False, step=step)
    print(f"losses on one device: {want_losses}")
    assert min(want_losses) < LIMIT < max(want_losses)  # (the gate matters here)
    make_world(4)
    got, losses = models.train(Encoder(nnx.Rngs(0, mixup=1)), data, wrap=True, step=step)
    d = models.max_diff(models.flat_params(got), models.flat_params(want))
    print(f"the all-reduced decision: {d:.1e} from one device")
    assert d < 1e-6
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert fleet.check_replicas(got) == []


def test_a_decision_the_step_combines_over_the_replicas_trains_as_on_one_device(make_world):
    """Skip a step whose loss is not finite, agreed by every replica
    (``fleet.all_reduce(..., 'min')``: the global loss is finite when every replica's
    is): the step's own combination, not refused (it was, as a replica's decision)."""
    data = models.batches("linear", 3, 16)
    data[1][1][5, 0] = float("nan")  # (one row of the second batch: its step is skipped)
    step = gated_step(lambda loss: fleet.all_reduce(
        jnp.isfinite(loss).astype(jnp.float32), "min") > 0.5, "cond")
    want, want_losses = models.train(Encoder(nnx.Rngs(0, mixup=1)), data, wrap=False, step=step)
    make_world(4)
    got, losses = models.train(Encoder(nnx.Rngs(0, mixup=1)), data, wrap=True, step=step)
    assert jnp.isnan(want_losses[1]) and jnp.isnan(losses[1])
    d = models.max_diff(models.flat_params(got), models.flat_params(want))
    print(f"the agreed skip: {d:.1e} from one device")
    assert d < 1e-6
    assert fleet.check_replicas(got) == []


def block_updates(model, optimizer, x, y):
    """An update per micro-batch: each of the batch's two blocks of consecutive
    rows (``x.reshape(2, -1, ...)``) in turn."""
    for xs, ys in zip(x.reshape(2, -1, x.shape[1]), y.reshape(2, -1, y.shape[1])):
        grads = nnx.grad(lambda m, xs=xs, ys=ys: jnp.mean((m(xs) - ys) ** 2))(model)
        optimizer.update(model, grads)


def pair_means(model, optimizer, x, y):
    """Each pair of consecutive rows (two views of one example) averaged: the
    pairs are the same on a replica as on one device."""
    def loss_fn(m):
        z = m(x).reshape(-1, 2, 8).mean(1)
        return jnp.mean((z - y.reshape(-1, 2, y.shape[1])[:, 0, :8]) ** 2)
    optimizer.update(model, nnx.grad(loss_fn)(model))


def test_an_update_per_block_of_rows_is_refused(make_world):
    """Each replica's block i is of its own rows; on one device block i is the
    global batch's rows 8i..8i+7. The updates between blocks made the difference
    silent (0.17 in the parameters after 3 steps of a probe); the blocks' shapes
    on a replica are those of pairs of rows, so the single-device trace tells."""
    make_world(4)
    model = fleet.distributed_model(Encoder(nnx.Rngs(0, mixup=1)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=r"a block of the rows picked.*gradient_merge"):
        fleet.distributed_step(block_updates)(model, optimizer,
                                              *models.batches("linear", 1, 16)[0])


def test_pairs_of_consecutive_rows_train_as_on_one_device(make_world):
    data = models.batches("linear", 2, 16)
    want = Encoder(nnx.Rngs(0, mixup=1))
    want_opt = nnx.Optimizer(want, optax.sgd(0.1), wrt=nnx.Param)
    for x, y in data:
        nnx.jit(pair_means)(want, want_opt, x, y)
    make_world(4)
    model = fleet.distributed_model(Encoder(nnx.Rngs(0, mixup=1)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(pair_means)
    for x, y in data:
        step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), models.flat_params(want)) < 1e-6
