"""``fleet.check_replicas``: do all copies of a replicated value agree?

A replicated array (sharding ``P()``) holds one copy per device. fleet keeps
them equal; this check proves it. Inside one process it compares every
addressable copy with the first; across processes it compares a checksum of
each process's first copy (through JAX's key-value store, bounded in time).
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np

from fleet._agree import agree
from fleet._tree import dotted


def _copies_differ(x: jax.Array) -> list[int]:
    """Indices of the local devices whose copy differs from the first copy."""
    shards = x.addressable_shards
    first = np.asarray(shards[0].data)
    return [s.device.id for s in shards[1:]
            if not np.array_equal(np.asarray(s.data), first, equal_nan=True)]


def check_replicas(tree: Any) -> list[str]:
    """The leaves of ``tree`` whose device or process copies differ (empty: all agree).

    Each entry names the leaf (its dotted path in ``tree``) and the devices or
    processes that disagree. Leaves that are not replicated arrays (sharded
    batches, numpy arrays) are skipped. In a multi-process job every process
    must call it.

    Example:
        >>> fleet.check_replicas(fleet.DataParallel(model))  # doctest: +SKIP
        []
    """
    from flax import nnx

    if isinstance(tree, nnx.Pytree):
        tree = nnx.state(tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    found: list[str] = []
    sums = []
    for path, x in flat:
        if not isinstance(x, jax.Array) or not x.is_fully_replicated:
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        bad = _copies_differ(x)
        name = dotted(path) or "the value"
        if bad:
            found.append(f"{name} (device {x.addressable_shards[0].device.id} and device(s) {bad})")
        sums.append((name, zlib.crc32(np.ascontiguousarray(x.addressable_shards[0].data).tobytes())))
    if jax.process_count() > 1:
        everyone = agree("check_replicas", ",".join(str(s) for _, s in sums))
        mine = jax.process_index()
        for rank, text in enumerate(everyone):
            theirs = text.split(",") if text else []
            for (name, s), t in zip(sums, theirs):
                if str(s) != t:
                    found.append(f"{name} (process {mine} and process {rank})")
                    break
    return found
