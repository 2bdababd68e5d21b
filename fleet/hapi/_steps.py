"""The steps ``fleet.Model`` runs, as pure per-replica functions for
``fleet.distributed_step``.

Each is written as for one device, on this replica's rows, and names its batch
arguments (``batch_argnums``: the inputs and the labels): the distributed step
averages the gradients (through the distributed optimizer), averages the
scalar loss over the replicas, and gathers the per-example arrays (metric rows,
per-example losses, predictions) in global batch order.

Dropout: each replica draws its own rows of the mask the single-device step
draws on the global batch (``fleet.semantics._random``), so training equals one device's,
and the RNG state stays identical (replicated) everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet._errors import FleetConfigError
from fleet.step._decorator import DistributedStep, distributed_step


def batch_rows(outputs: Any) -> int:
    leaves = jax.tree_util.tree_leaves(outputs)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        raise FleetConfigError(
            "the network returned no per-example array (leading axis = batch); fleet.Model "
            "needs outputs like logits of shape (batch, ...)"
        )
    return jnp.shape(leaves[0])[0]


def mean_loss(value: Any) -> jax.Array:
    """The loss to differentiate: the mean of what the loss function returned."""
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise FleetConfigError(
            f"the loss function returned {value.dtype} values; it must return floats "
            "(a scalar, or one value per example)"
        )
    return value.mean()


def per_example_loss(loss_fn: Callable, outputs: Any, labels: Sequence[Any]) -> jax.Array:
    """One loss value per example, for exact evaluation.

    A loss that returns one value per example (optax's losses) is used as it is;
    one that returns the batch mean is applied to each example alone (``vmap``).
    """
    rows = batch_rows(outputs)
    value = jnp.asarray(loss_fn(outputs, *labels))
    if value.ndim >= 1 and value.shape[0] == rows:
        mean_loss(value)  # checks the dtype
        return value.reshape(rows, -1).mean(axis=1)
    if value.ndim == 0:
        def one(o: Any, *ls: Any) -> jax.Array:
            single = jax.tree.map(lambda x: x[None], (o, *ls))
            return mean_loss(loss_fn(*single))

        return jax.vmap(one)(outputs, *labels)
    raise FleetConfigError(
        f"the loss function returned shape {value.shape} for a batch of {rows}; return a "
        f"scalar or one value per example (leading axis {rows})"
    )


def metric_rows(metrics: Sequence[Any], outputs: Any, labels: Sequence[Any]) -> tuple:
    """Each metric's per-example ``compute`` outputs, as tuples."""
    rows = []
    for metric in metrics:
        out = metric.compute(outputs, *labels)
        rows.append(tuple(out) if isinstance(out, (tuple, list)) else (out,))
    return tuple(rows)


def make_train_step(loss_fn: Callable, metrics: Sequence[Any]) -> DistributedStep:
    """``step(network, optimizer, inputs, labels, scale) -> (mean loss, metric rows)``.

    The gradient is that of ``scale * loss`` (the returned loss is unscaled): under
    ``no_sync`` gradients add up, so ``fit(accumulate_grad_batches=k)`` passes
    ``1 / k`` to update with the mean over the ``k`` batches, one step on their union.
    """

    def train_step(network, optimizer, inputs, labels, scale):
        def objective(net):
            outputs = net(*inputs)
            loss = mean_loss(loss_fn(outputs, *labels))
            return loss * scale, (loss, outputs)

        (_, (loss, outputs)), grads = nnx.value_and_grad(objective, has_aux=True)(network)
        optimizer.update(network, grads)
        return loss, metric_rows(metrics, outputs, labels)

    return distributed_step(train_step, batch_argnums=(2, 3))


def make_eval_step(loss_fn: Callable | None, metrics: Sequence[Any]) -> DistributedStep:
    """``step(network, inputs, labels) -> (per-example loss or None, metric rows)``."""

    def eval_step(network, inputs, labels):
        outputs = network(*inputs)
        losses = None if loss_fn is None else per_example_loss(loss_fn, outputs, labels)
        return losses, metric_rows(metrics, outputs, labels)

    return distributed_step(eval_step, batch_argnums=(1, 2))


def make_predict_step() -> DistributedStep:
    """``step(network, inputs) -> the network's outputs`` (per example)."""

    def predict_step(network, inputs):
        outputs = network(*inputs)
        batch_rows(outputs)
        return outputs

    return distributed_step(predict_step, batch_argnums=(1,))
