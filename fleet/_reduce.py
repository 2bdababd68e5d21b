"""Buckets, and averaging gradients that still differ across replicas.

Gradient leaves are taken in model order (the pytree's leaf order) and grouped
into buckets of at most ``comm_buffer_size`` MB; the first bucket, which holds
the model's first layers (whose gradients backward produces last), is capped at
``last_comm_buffer_size`` MB so that its all-reduce, which nothing can overlap,
stays short. A leaf larger than its cap gets a bucket of its own;
``fuse=False`` means one bucket per leaf.

A wrapped model reduces its gradients in the backward pass, one custom-VJP
call per bucket (:mod:`fleet._sync`); its bucket is one ``jax.lax.psum`` of the
bucket's leaves as a list. fleet does not concatenate a bucket into one buffer:
that costs a copy of the bucket before and after the collective, which XLA
cannot remove across it, and XLA already merges the list's all-reduces -- on
CPU all of them, on GPU up to ``--xla_gpu_all_reduce_combine_threshold_bytes``
(30 MiB by default, about fleet's default 32 MB bucket), so on GPU each default
bucket runs as about one NCCL all-reduce. To make fleet's buckets the exact
unit, set that flag to the bucket size in ``XLA_FLAGS``.

:func:`reduce_gradients` (the distributed optimizer, ``apply_collective_grads``,
``fused_allreduce_gradients``) averages only the leaves that still *vary*
across replicas (their vma type says so); a wrapped model's gradients are
invariant already and pass through, so nothing is reduced twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fleet._context import BucketConfig
from fleet._errors import FleetError

MB = 1 << 20


def plan_buckets(nbytes: Sequence[int], config: BucketConfig) -> list[list[int]]:
    """Groups leaf indices (model order) into buckets; see the module docstring.

    Example:
        >>> plan_buckets([3 * MB, 3 * MB, 3 * MB], BucketConfig(5, 1))
        [[0], [1], [2]]
        >>> plan_buckets([MB // 2, MB // 2, 3 * MB, MB], BucketConfig(5, 1))
        [[0, 1], [2, 3]]
    """
    if not config.fuse:
        return [[i] for i in range(len(nbytes))]
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, config.last_comm_buffer_size * MB
    for i, n in enumerate(nbytes):
        if current and size + n > cap:
            buckets.append(current)
            current, size, cap = [], 0, config.comm_buffer_size * MB
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def allreduce_mean(leaves: list, config: BucketConfig) -> list:
    """Averages varying ``leaves`` over the ``data`` axis, one psum per bucket
    (in ``config.wire_dtype`` if set); invariant leaves (equal on every replica
    already) come back as they are."""
    from fleet._sync import is_varying, mean_over_replicas

    out = list(leaves)
    todo = [i for i, x in enumerate(leaves) if is_varying(x)]
    nbytes = [leaves[i].size * jnp.result_type(leaves[i]).itemsize for i in todo]
    for bucket in plan_buckets(nbytes, config):
        idx = [todo[j] for j in bucket]
        for i, y in zip(idx, mean_over_replicas([leaves[i] for i in idx], config.wire_dtype)):
            out[i] = y
    return out


def strategy_buckets() -> BucketConfig:
    """The buckets of the strategy given to ``fleet.init`` (the defaults before it)."""
    from fleet._world import current_strategy

    s = current_strategy()
    wire = None
    if s.fp16_allreduce:
        wire = "float16" if s.amp_configs.compute_dtype == "float16" else "bfloat16"
    return BucketConfig(s.fuse_grad_size_in_MB, s.last_comm_group_size_MB, s.fuse_all_reduce_ops,
                        wire)


def reduce_gradients(grads: Any, config: BucketConfig | None = None) -> Any:
    """``grads`` averaged over the replicas (see the module docstring). Outside a
    step (and with one replica) it returns ``grads``."""
    from fleet._sync import current

    if current() is None:
        return _outside_step(grads)
    config = config or strategy_buckets()
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    return jax.tree_util.tree_unflatten(treedef, allreduce_mean(leaves, config))


def _outside_step(grads: Any) -> Any:
    from fleet._world import is_initialized, world

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
