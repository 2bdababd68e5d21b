"""ZeRO's collectives and hooks (``strategy.sharding``, :mod:`fleet.sections._sharding`):
a bucket's reduce-scatter of gradients into slices (:class:`ReduceScatter`, the
hook :func:`fleet.comm._hooks.gradient_hook` picks under sharding), the
all-gather of the updated slices (:class:`AllGather`, :func:`gather`), and a
replica's own slice of a full array. Each collective is a ``jit`` named
``fleet_*`` in the jaxpr, which the step's guards know as fleet's own; the
buckets are planned and looped over in :mod:`fleet.comm._buckets`.

A slice: a full array flattened, padded with zeros to ``degree * chunk`` and cut
into ``degree`` rows of ``chunk`` (a :class:`fleet.sections._sharding.Layout`); replica
``r`` owns row ``r % degree``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet.comm._buckets import MB, Bucket, BucketConfig, plan_leaves, reduce_buckets
from fleet.runtime._world import DATA_AXIS, world


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one logical array of ``shape`` is split: ``degree`` chunks of ``chunk``
    elements (zero padded), laid out over ``replicas`` rows."""

    shape: tuple[int, ...]
    degree: int
    replicas: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk(self) -> int:
        return max(1, -(-self.size // self.degree))

    @property
    def padded(self) -> int:
        return self.chunk * self.degree


@functools.cache
def _converters(layout: Layout, mesh: Any) -> tuple[Any, Any]:
    def shards(x):
        flat = jnp.pad(jnp.ravel(x), (0, layout.padded - layout.size))
        return jnp.tile(flat.reshape(layout.degree, layout.chunk),
                        (layout.replicas // layout.degree, 1))

    def logical(x):
        return x[:layout.degree].reshape(-1)[:layout.size].reshape(layout.shape)

    return (jax.jit(shards, out_shardings=NamedSharding(mesh, P(DATA_AXIS))),
            jax.jit(logical, out_shardings=NamedSharding(mesh, P())))


def to_shards(x: Any, layout: Layout) -> jax.Array:
    """A logical array as the global ``(replicas, chunk)`` array sharded over ``data``."""
    return _converters(layout, world().mesh)[0](x)


def to_logical(x: jax.Array, layout: Layout) -> jax.Array:
    """The logical array (replicated) of a sharded one; the padding is dropped."""
    return _converters(layout, world().mesh)[1](x)


@functools.partial(jax.jit, static_argnames=("specs", "vary"))
def fleet_shard_grad(specs: tuple, vary: bool = False) -> list:
    """Placeholders (zeros) for the gradients of a sharded step: the reduced
    gradient exists only as slices (see :mod:`fleet.sections._sharding`). A ``jit``
    named so in the jaxpr: the step refuses a program that reads them. ``vary``:
    typed varying (stage 3's, the gradients of per-replica slices)."""
    zeros = [jnp.zeros(shape, dtype) for shape, dtype in specs]
    return [jax.lax.pcast(z, DATA_AXIS, to="varying") for z in zeros] if vary else zeros


def _shard_index(layout_degree: int) -> Any:
    return jax.lax.axis_index(DATA_AXIS) % layout_degree


def padded_rows(x: Any, layout: Layout) -> Any:
    """A full (per-replica) array as ``(degree, chunk)``: flattened and padded."""
    return jnp.pad(jnp.ravel(x), (0, layout.padded - layout.size)).reshape(
        layout.degree, layout.chunk)


def own_slice(x: Any, layout: Layout) -> Any:
    """This replica's chunk of a full array."""
    return jax.lax.dynamic_index_in_dim(padded_rows(x, layout), _shard_index(layout.degree),
                                        keepdims=False)


@functools.partial(jax.jit, static_argnames=("wire", "scatter"))
def fleet_scatter(*leaves: Any, wire: str | None = None, scatter: bool = True) -> list:
    """One bucket's reduce-scatter: ``(degree, chunk)`` rows summed over the
    replicas, each replica keeping its chunk, then divided by the replica count
    (the mean). ``scatter=False`` (hybrid sharding, or the one-device trace):
    an all-reduce, then the replica's chunk."""
    n = jax.lax.axis_size(DATA_AXIS)
    sent = [(x / n).astype(wire) if wire else x for x in leaves]
    if scatter:
        out = jax.lax.psum_scatter(sent, DATA_AXIS, scatter_dimension=0, tiled=False)
    else:
        summed = jax.lax.psum(sent, DATA_AXIS)
        out = [jax.lax.dynamic_index_in_dim(s, jax.lax.axis_index(DATA_AXIS) % s.shape[0],
                                            keepdims=False) for s in summed]
    if wire:
        return [o.astype(x.dtype) for o, x in zip(out, leaves)]
    return [o / n for o in out]


@jax.jit
def fleet_gather(*slices: Any) -> list:
    """One all-gather bucket: each of the replicas' chunks gathered into its
    ``(replicas, chunk)`` rows (invariant: every replica gets the same rows). The
    bucket is a list, not one concatenated buffer: concatenating costs a copy
    of the bucket's slices, which XLA cannot remove across the collective (the
    MLP of benchmarks/donation.py held its 8 MB of slices per device twice), and
    XLA merges the list's all-gathers itself."""
    return list(jax.lax.all_gather(list(slices), DATA_AXIS, to="invarying"))


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
    """ZeRO's hook (``strategy.sharding``): the mean of this replica's slice of
    each leaf (per-replica local gradients in, slices out). ``shard`` is the
    step's :class:`fleet.sections._sharding.Config`."""

    shard: Any

    def __call__(self, bucket: Bucket, leaves: list) -> list:
        cfg = self.shard
        rows = [padded_rows(x, cfg.layout(jnp.shape(x))) for x in leaves]
        scatter = cfg.degree == cfg.replicas == jax.lax.axis_size(DATA_AXIS)
        if scatter or jax.lax.axis_size(DATA_AXIS) == cfg.replicas:
            return fleet_scatter(*rows, wire=cfg.wire, scatter=scatter)
        return [r[0] for r in rows]  # the single-device trace (fleet.step._guards)


@dataclasses.dataclass(frozen=True)
class AllGather:
    """ZeRO's way back: full arrays from the replicas' slices; ``layouts`` are
    those of the whole list the plan was made for (``bucket.members`` index it)."""

    layouts: tuple[Layout, ...]

    def __call__(self, bucket: Bucket, slices: list) -> list:
        out = []
        for i, r in zip(bucket.members, fleet_gather(*slices)):
            lay = self.layouts[i]
            if r.shape[0] != lay.replicas:  # the single-device trace
                r = jnp.tile(r, (lay.replicas, 1))
            out.append(r[:lay.degree].reshape(-1)[:lay.size].reshape(lay.shape))
        return out


def gather(slices: Sequence, layouts: Sequence[Layout], gather_bytes: int) -> list:
    """Full arrays from the replicas' slices, in all-gather buckets of
    ``gather_bytes`` (``segment_broadcast_MB``), one dtype per bucket."""
    size = gather_bytes / MB
    plan = plan_leaves(slices, BucketConfig(size, size), by_dtype=True)
    return reduce_buckets(plan, slices, AllGather(tuple(layouts)))
