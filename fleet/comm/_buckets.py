"""Buckets: how gradient leaves are grouped for the all-reduce.

``BucketConfig`` is the plan's settings; a wrapped model carries one
(``fleet.DataParallel(comm_buffer_size=...)``), and the strategy's
``fuse_grad_size_in_MB`` / ``last_comm_group_size_MB`` give the defaults
(:func:`strategy_buckets`).

Gradient leaves are taken in model order (the pytree's leaf order) and grouped
into buckets of at most ``comm_buffer_size`` MB; the first bucket, which holds
the model's first layers (whose gradients backward produces last), is capped at
``last_comm_buffer_size`` MB so that its all-reduce, which nothing can overlap,
stays short. A leaf larger than its cap gets a bucket of its own;
``fuse=False`` means one bucket per leaf (:func:`plan_buckets`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


def strategy_buckets() -> BucketConfig:
    """The buckets of the strategy given to ``fleet.init`` (the defaults before it)."""
    s = current_strategy()
    wire = None
    if s.fp16_allreduce:
        wire = "float16" if s.amp_configs.compute_dtype == "float16" else "bfloat16"
    return BucketConfig(s.fuse_grad_size_in_MB, s.last_comm_group_size_MB, s.fuse_all_reduce_ops,
                        wire)
