"""Averaging gradients that still differ across replicas, in buckets
(:mod:`fleet.comm._buckets`).

A wrapped model reduces its gradients in the backward pass, one custom-VJP
call per bucket (:mod:`fleet.comm._sync`); its bucket is one ``jax.lax.psum``
of the bucket's leaves as a list (:func:`fleet.comm._hooks.mean_all_reduce`).
fleet does not concatenate a bucket into one buffer: that costs a copy of the
bucket before and after the collective, which XLA cannot remove across it, and
XLA already merges the list's all-reduces -- on CPU all of them, on GPU up to
``--xla_gpu_all_reduce_combine_threshold_bytes`` (30 MiB by default, about
fleet's default 32 MB bucket), so on GPU each default bucket runs as about one
NCCL all-reduce. To make fleet's buckets the exact unit, set that flag to the
bucket size in ``XLA_FLAGS``.

:func:`reduce_gradients` (the distributed optimizer, ``apply_collective_grads``,
``fused_allreduce_gradients``) averages only the leaves that still *vary*
across replicas (their vma type says so); a wrapped model's gradients are
invariant already and pass through, so nothing is reduced twice.
"""

from __future__ import annotations

from typing import Any

import jax

from fleet._errors import FleetError
from fleet.comm._buckets import BucketConfig, plan_leaves, reduce_buckets, strategy_buckets
from fleet.comm._hooks import gradient_hook
from fleet.comm._sync import current, is_varying
from fleet.runtime._world import is_initialized, world


def allreduce_mean(leaves: list, config: BucketConfig) -> list:
    """Averages varying ``leaves`` over the ``data`` axis, one psum per bucket
    (in ``config.wire_dtype`` if set); invariant leaves (equal on every replica
    already) come back as they are."""
    todo = [i for i, x in enumerate(leaves) if is_varying(x)]
    return reduce_buckets(plan_leaves(leaves, config, todo), leaves,
                          gradient_hook(config.wire_dtype))


def reduce_gradients(grads: Any, config: BucketConfig | None = None) -> Any:
    """``grads`` averaged over the replicas (see the module docstring). Outside a
    step (and with one replica) it returns ``grads``."""
    if current() is None:
        return _outside_step(grads)
    config = config or strategy_buckets()
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    return jax.tree_util.tree_unflatten(treedef, allreduce_mean(leaves, config))


def _outside_step(grads: Any) -> Any:
    if not is_initialized() or world().num_replicas == 1:
        return grads
    raise FleetError(
        f"gradients can only be averaged over the {world().num_replicas} data-parallel "
        "replicas inside a step: decorate the function that computes and applies them "
        "with @fleet.distributed_step (instead of jax.jit)"
    )


def fused_allreduce_gradients(grads: Any, config: BucketConfig | None = None) -> Any:
    """Averages a gradient pytree over the replicas, in buckets (Paddle's helper).

    Inside a :func:`fleet.distributed_step`. Gradients of a wrapped model are
    averaged already by its backward pass and come back unchanged; gradients that
    still differ per replica are averaged. With one replica and outside a step it
    returns ``grads``.

    Example:
        >>> @fleet.distributed_step  # doctest: +SKIP
        ... def step(model, optimizer, x, y):
        ...     grads = nnx.grad(loss_fn)(model, x, y)
        ...     grads = fleet.fused_allreduce_gradients(grads)
        ...     optimizer.update(model, grads)
    """
    return reduce_gradients(grads, config)
