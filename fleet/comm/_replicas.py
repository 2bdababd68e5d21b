"""``fleet.check_replicas``: do all copies of a replicated value agree?

A replicated array (sharding ``P()``) holds one copy per device. fleet keeps
them equal; this check proves it. Inside one process it compares every
addressable copy with the first; across processes it compares a checksum of
each process's first copy (through JAX's key-value store, bounded in time).

The copies are compared bit for bit where they are. On CPU devices (host
memory) numpy compares them in place. On accelerators one program computes, on
each device, two position-weighted sums of each leaf's bits (modulo 2**32), and
only those come back to the host (8 bytes per leaf and device): a check costs
one read of the state in device memory, not a copy of it to the host.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fleet.runtime._agree import agree
from fleet.runtime._leaves import dotted

_COPIES = "copies"  # the axis of a leaf's device copies, in the fingerprint program


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as one flat uint32 vector (each element's bits, widened)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)


def _fingerprint(x: jax.Array) -> jax.Array:
    """Two position-weighted sums of ``x``'s bits, modulo 2**32: equal bits give equal
    sums whatever the summation order; a changed element changes them."""
    u = _words(x)
    i = jnp.arange(u.size, dtype=jnp.uint32)
    a = jnp.sum(u * (i * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)
    b = jnp.sum((u ^ (u >> 15)) * (i * jnp.uint32(2246822519) + jnp.uint32(3266489917)),
                dtype=jnp.uint32)
    return jnp.stack([a, b])


@functools.lru_cache(maxsize=16)
def _program(devices: tuple) -> tuple[Mesh, Any]:
    """The fingerprints of each device's copies of some leaves, on those devices:
    one call, two uint32 per leaf and device come back."""
    mesh = Mesh(np.array(devices), (_COPIES,))

    def per_device(*copies):
        return jnp.stack([_fingerprint(c) for c in copies])[None]

    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(_COPIES),
                                    out_specs=P(_COPIES), check_vma=False))
    return mesh, program


def _fingerprints(leaves: list[jax.Array]) -> np.ndarray:
    """``[device copy, leaf, 2]`` fingerprints of replicated ``leaves`` that share one
    set of devices: each copy stays where it is (read in place, not gathered)."""
    devices = tuple(s.device for s in leaves[0].addressable_shards)
    mesh, program = _program(devices)
    stacked = []
    for x in leaves:
        copies = {s.device: s.data if x.ndim else s.data.reshape(1) for s in x.addressable_shards}
        first = copies[devices[0]]
        stacked.append(jax.make_array_from_single_device_arrays(
            (len(devices) * first.shape[0], *first.shape[1:]),
            NamedSharding(mesh, P(_COPIES)), [copies[d] for d in devices]))
    return np.asarray(program(*stacked))


def _differ(devices: tuple, named: list[tuple[str, jax.Array]]) -> tuple[list, list]:
    """For leaves sharing ``devices``: each leaf's devices whose copy's bits differ
    from the first copy's, and a digest of the first copy (for other processes).
    CPU device memory is host memory, so numpy compares the copies in place there
    (faster than any program on the same cores); elsewhere :func:`_fingerprints`."""
    if devices[0].platform == "cpu":
        bad, digests = [], []
        for _, x in named:
            copies = [np.ascontiguousarray(s.data).reshape(-1).view(np.uint8)
                      for s in x.addressable_shards]
            bad.append([s.device.id for s, c in zip(x.addressable_shards[1:], copies[1:])
                        if not np.array_equal(c, copies[0])])
            digests.append(f"{zlib.crc32(copies[0]):08x}")
        return bad, digests
    prints = _fingerprints([x for _, x in named])  # [copy, leaf, 2]
    bad = [[d.id for d, p in zip(devices[1:], prints[1:, j]) if (p != prints[0, j]).any()]
           for j in range(len(named))]
    return bad, [f"{a:08x}{b:08x}" for a, b in prints[0]]


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
    if isinstance(tree, nnx.Pytree):
        tree = nnx.state(tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    groups: dict[tuple, list[tuple[str, jax.Array]]] = {}
    for path, x in flat:
        if not isinstance(x, jax.Array) or not x.is_fully_replicated:
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        devices = tuple(s.device for s in x.addressable_shards)
        groups.setdefault(devices, []).append((dotted(path) or "the value", x))
    found: list[str] = []
    sums = []
    for devices, named in groups.items():
        for (name, _), bad, digest in zip(named, *_differ(devices, named)):
            if bad:
                found.append(f"{name} (device {devices[0].id} and device(s) {bad})")
            sums.append((name, digest))
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
