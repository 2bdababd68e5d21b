"""Communication hooks: what happens to one bucket of leaves (torch's
``ddp_comm_hooks``: ``allreduce_hook``, ``fp16_compress_hook``, ZeRO's hooks).

A hook is called by the one bucket loop, :func:`fleet.comm._buckets.reduce_buckets`,
with a :class:`~fleet.comm._buckets.Bucket` and the bucket's leaves, and returns
their reduced values. The gradient hook of a step is chosen from the strategy in
one place, :func:`gradient_hook`:

* :func:`mean_all_reduce`: the mean over the replicas (``psum``, then divided by
  the replica count), the default;
* :func:`fp16_compress` (``strategy.fp16_allreduce``): float leaves divided by
  the replica count first, so that a 16-bit sum cannot overflow, summed in the
  16-bit wire dtype and cast back, as torch's ``bf16_compress_hook``;
* :class:`~fleet.comm._shard_comm.ReduceScatter` (``strategy.sharding``, ZeRO): each leaf as
  ``(degree, chunk)`` rows, reduce-scattered, so each replica keeps the mean of
  its own chunk (its slice); in the wire dtype too under ``fp16_allreduce``;
* :class:`Divided`: another hook's result divided by the step's gradient divisor
  (float16 amp's loss scale, gradient merge's average).

:class:`~fleet.comm._shard_comm.AllGather` (ZeRO's gather of the updated
slices) is the way back; :func:`zero_backward` is a wrapped model's bucket
backward under sharding (stage 2 reduces now, stage 1 after the backward pass).

Each collective is one ``jit`` named ``fleet_*`` in the jaxpr (``fleet_bucket``,
``fleet_scatter``, ``fleet_gather``), casts included, so that the step's guards
know it as fleet's own (``fleet.comm._sync.FLEET_CALLS``) and tests can count the
buckets; XLA inlines it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fleet.comm._buckets import Bucket, Hook, plan_leaves, reduce_buckets, strategy_buckets
from fleet.comm._shard_comm import ReduceScatter, fleet_shard_grad
from fleet.runtime._world import DATA_AXIS

# --------------------------------------------------------------------------- collectives


@functools.partial(jax.jit, static_argnames="wire")
def fleet_bucket(*leaves: Any, wire: str | None = None) -> list:
    """One bucket's average over the replicas: a ``jit`` named ``fleet_bucket`` in
    the jaxpr (so the buckets can be counted), inlined by XLA.

    With ``wire`` (``strategy.fp16_allreduce``) float leaves are divided by the
    replica count first, so that a 16-bit sum cannot overflow (torch's
    ``bf16_compress_hook``), summed in ``wire`` and cast back."""
    n = jax.lax.axis_size(DATA_AXIS)
    if wire is None:
        out = jax.lax.psum(list(leaves), DATA_AXIS)
        return [s / n if jnp.issubdtype(s.dtype, jnp.inexact) else s // n for s in out]
    floats = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
    sent = [(x / n).astype(wire) if f else x for x, f in zip(leaves, floats)]
    out = jax.lax.psum(sent, DATA_AXIS)
    return [s.astype(x.dtype) if f else s // n for s, x, f in zip(out, leaves, floats)]


# --------------------------------------------------------------------------- hooks


def mean_all_reduce(bucket: Bucket, leaves: list) -> list:
    """The bucket's mean over the replicas (torch's ``allreduce_hook``)."""
    return list(fleet_bucket(*leaves))


@dataclasses.dataclass(frozen=True)
class Compressed:
    """The bucket's mean over the replicas, sent in the 16-bit ``wire`` dtype
    (torch's ``fp16_compress_hook``): the cast, the sum and the cast back are one
    ``fleet_bucket`` call (see :func:`fleet_bucket`)."""

    wire: str

    def __call__(self, bucket: Bucket, leaves: list) -> list:
        return list(fleet_bucket(*leaves, wire=self.wire))


def fp16_compress(wire: str) -> Hook:
    """``strategy.fp16_allreduce``'s hook: the mean, sent in ``wire``."""
    return Compressed(wire)


@dataclasses.dataclass(frozen=True)
class Divided:
    """``inner``'s result divided by ``divisor`` (a traced scalar), leaf by leaf."""

    inner: Hook
    divisor: Any

    def __call__(self, bucket: Bucket, leaves: list) -> list:
        return [g / self.divisor.astype(g.dtype) for g in self.inner(bucket, leaves)]


def gradient_hook(wire: str | None, divisor: Any = None, shard: Any = None) -> Hook:
    """The one place the strategy picks a gradient bucket's hook: ZeRO's
    reduce-scatter under ``strategy.sharding`` (``shard``: its config), else the
    mean, in ``wire`` under ``strategy.fp16_allreduce``; divided by ``divisor``
    (the step's loss scale or merge average) when there is one."""
    if shard is not None:
        hook: Hook = ReduceScatter(shard)
    else:
        hook = mean_all_reduce if wire is None else fp16_compress(wire)
    return hook if divisor is None else Divided(hook, divisor)


# --------------------------------------------------------------------------- ZeRO's loops


def reduce_slices(leaves: Sequence, cfg: Any, divisor: Any = None) -> list:
    """The reduced (mean) gradient slices of per-replica local gradients, one
    reduce-scatter per gradient bucket (``fuse_grad_size_in_MB``); ``cfg`` is the
    step's :class:`fleet.sections._sharding.Config`."""
    return reduce_buckets(plan_leaves(leaves, strategy_buckets()), leaves,
                          gradient_hook(cfg.wire, divisor, shard=cfg))


def zero_backward(trace: Any, keys: Sequence, cts: list) -> list:
    """A wrapped model's bucket backward under ``strategy.sharding`` (``trace``:
    the step's :class:`fleet.comm._trace.SyncTrace`): stage 2 reduce-scatters the
    bucket now, stage 1 keeps the local gradients for the optimizer
    (:mod:`fleet.sections._sharding`); both return placeholders."""
    cfg = trace.shard.config
    if cfg.stage == 2:
        values = reduce_slices(cts, cfg, trace.tx.divisor)
        trace.finite.record([f"gradient of {k!r}" for k in keys], values)
    else:
        values = cts
    held = fleet_shard_grad(tuple((ct.shape, jnp.dtype(ct.dtype).name) for ct in cts))
    for k, i, v in zip(keys, trace.hold(held), values):
        trace.shard.grads[i] = (k, v, cfg.stage == 2)
    return held
