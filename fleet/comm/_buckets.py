"""Buckets: how leaves are grouped for a collective, and the one loop over them.

``BucketConfig`` is the plan's settings; a wrapped model carries one
(``fleet.DataParallel(comm_buffer_size=...)``), and the strategy's
``fuse_grad_size_in_MB`` / ``last_comm_group_size_MB`` give the defaults
(:func:`strategy_buckets`).

Gradient leaves are taken in model order (the pytree's leaf order) and grouped
into buckets of at most ``comm_buffer_size`` MB; the first bucket, which holds
the model's first layers (whose gradients backward produces last), is capped at
``last_comm_buffer_size`` MB so that its all-reduce, which nothing can overlap,
stays short. A leaf larger than its cap gets a bucket of its own;
``fuse=False`` means one bucket per leaf (:func:`plan_buckets`). Given
``kinds``, a bucket also ends where the kind changes (ZeRO's all-gather keeps
one dtype per bucket).

Every bucketed collective in fleet runs through :func:`reduce_buckets`, which
calls a hook (:mod:`fleet.comm._hooks`) once per bucket, as torch's DDP reducer
calls its communication hook: the wrapped model's backward pass
(:mod:`fleet.comm._sync`), the functional reducer (:mod:`fleet.comm._reduce`),
ZeRO's reduce-scatter and all-gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from fleet.runtime._world import current_strategy
from fleet.strategy._configs import DEFAULT_BUCKET_MB, DEFAULT_LAST_BUCKET_MB

MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """How gradients are grouped for the all-reduce (sizes in MB of 2**20 bytes)."""

    comm_buffer_size: float = DEFAULT_BUCKET_MB
    last_comm_buffer_size: float = DEFAULT_LAST_BUCKET_MB
    fuse: bool = True
    #: ``strategy.fp16_allreduce``: the 16-bit dtype name the buckets travel in
    #: (divided by the replica count first), or None for the gradients' own dtype.
    wire_dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket of a plan, as a hook sees it (torch's ``GradBucket``): its place
    in the plan (0: the model's first layers) and the positions of its leaves in
    the list the plan was made for."""

    index: int
    members: tuple[int, ...]


#: A communication hook: one bucket's leaves in, their reduced values out (in order).
Hook = Callable[[Bucket, list], Sequence]


def plan_buckets(nbytes: Sequence[int], config: BucketConfig,
                 kinds: Sequence[Any] | None = None) -> list[list[int]]:
    """Groups leaf indices (model order) into buckets; see the module docstring.

    Example:
        >>> plan_buckets([3 * MB, 3 * MB, 3 * MB], BucketConfig(5, 1))
        [[0], [1], [2]]
        >>> plan_buckets([MB // 2, MB // 2, 3 * MB, MB], BucketConfig(5, 1))
        [[0, 1], [2, 3]]
        >>> plan_buckets([8, 8, 8], BucketConfig(5, 5), kinds=["f4", "f4", "f2"])
        [[0, 1], [2]]
    """
    if not config.fuse:
        return [[i] for i in range(len(nbytes))]
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, config.last_comm_buffer_size * MB
    for i, n in enumerate(nbytes):
        if current and (size + n > cap or (kinds is not None and kinds[i] != kinds[current[0]])):
            buckets.append(current)
            current, size, cap = [], 0, config.comm_buffer_size * MB
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def plan_leaves(leaves: Sequence, config: BucketConfig, select: Sequence[int] | None = None,
                by_dtype: bool = False) -> list[list[int]]:
    """:func:`plan_buckets` over ``leaves`` (those at positions ``select``, if
    given), by their bytes; the buckets hold positions in ``leaves``.
    ``by_dtype``: a bucket holds one dtype."""
    todo = list(range(len(leaves)) if select is None else select)
    nbytes = [leaves[i].size * jnp.result_type(leaves[i]).itemsize for i in todo]
    kinds = [leaves[i].dtype for i in todo] if by_dtype else None
    return [[todo[j] for j in bucket] for bucket in plan_buckets(nbytes, config, kinds)]


def reduce_buckets(plan: Sequence[Sequence[int]], leaves: Sequence, hook: Hook) -> list:
    """The one bucket loop: ``leaves`` with each bucket of ``plan`` replaced by what
    ``hook`` returns for it (buckets in plan order); leaves in no bucket pass
    through."""
    out = list(leaves)
    for index, members in enumerate(plan):
        bucket = Bucket(index, tuple(members))
        for i, y in zip(members, hook(bucket, [leaves[i] for i in members])):
            out[i] = y
    return out


def strategy_buckets() -> BucketConfig:
    """The buckets of the strategy given to ``fleet.init`` (the defaults before it)."""
    s = current_strategy()
    wire = None
    if s.fp16_allreduce:
        wire = "float16" if s.amp_configs.compute_dtype == "float16" else "bfloat16"
    return BucketConfig(s.fuse_grad_size_in_MB, s.last_comm_group_size_MB, s.fuse_all_reduce_ops,
                        wire)
