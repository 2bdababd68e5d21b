"""ZeRO stage 3's parameters (``sharding_configs.stage = 3``): gathered where the
model reads them, their gradients reduce-scattered on the way back.

A stage-3 parameter is stored as its replicas' slices (a
:class:`~fleet.comm._shard_comm.Layout`: flattened, zero padded, ``degree``
chunks), the optimizer state beside it in the same layout
(:mod:`fleet.sections._sharding`). Inside a step each replica holds its own
slice. Where the wrapped model reads its parameters, :func:`gather_leaves`
makes them whole, one custom-VJP call per bucket of ``segment_broadcast_MB``
(JAX's "fully sharded data parallelism" in its ``shard_map`` guide):

* forward, the bucket's slices are all-gathered
  (:class:`~fleet.comm._shard_comm.AllGather`) and cast to *varying*, as a
  synced parameter is (:mod:`fleet.comm._sync`), so its cotangent comes back
  local;
* backward, the bucket's local gradients are reduce-scattered by the step's
  gradient hook (:func:`fleet.comm._hooks.gradient_hook`: the mean of each
  replica's chunk, divided by the loss scale or merge average where there is
  one), as at stage 2. The slice is kept for the distributed optimizer
  (``trace.shard.grads``), and the gradient ``nnx.grad`` returns is a
  placeholder the step refuses to read (``fleet_shard_grad``), as at stages 1
  and 2: the reduced gradient exists only as slices.

A bucket read where nothing differentiates it (an evaluation, a norm of the
updated parameters) is gathered plainly: invariant, the same on every replica,
as a parameter read outside ``jax.grad`` is at the other stages.

A slice is gathered once per trace, as a parameter is synced once
(:func:`fleet.comm._sync.sync_leaves`): a second read gets the same whole
value, so the optimizer gets one gradient per parameter. The gathered values
are kept by id too (``trace.shard.whole``): a parameter that holds one is not
gathered again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fleet._compat import is_differentiated
from fleet.comm._buckets import MB, Bucket, BucketConfig, plan_leaves, reduce_buckets
from fleet.comm._hooks import gradient_hook
from fleet.comm._shard_comm import AllGather, Layout, fleet_shard_grad
from fleet.comm._trace import SyncTrace
from fleet.runtime._world import DATA_AXIS


def _varying(x: Any) -> Any:
    if DATA_AXIS in jax.typeof(x).manual_axis_type.varying:
        return x
    return jax.lax.pcast(x, DATA_AXIS, to="varying")


def _scatter_back(trace: SyncTrace, keys: tuple, layouts: tuple, cts: Sequence) -> list:
    """One bucket's backward: the local gradients' mean slices, kept for the
    optimizer; returns their placeholders (varying, as the slices were)."""
    cfg = trace.shard.config
    cts = [_varying(ct) for ct in cts]
    bucket = Bucket(0, tuple(range(len(cts))))
    values = gradient_hook(cfg.wire, trace.tx.divisor, shard=cfg)(bucket, cts)
    trace.finite.record([f"gradient of {k!r}" for k in keys], values)
    held = fleet_shard_grad(tuple(((lay.chunk,), jnp.dtype(ct.dtype).name)
                                  for lay, ct in zip(layouts, cts)), vary=True)
    for k, i, v, lay in zip(keys, trace.hold(held), values, layouts):
        trace.shard.grads[i] = (k, v, True)
        trace.shard.layouts[i] = lay
    return held


def _bucket_gather(trace: SyncTrace, keys: tuple, layouts: tuple) -> Any:
    """A custom-VJP gather of one bucket of slices (see the module docstring)."""
    gather = AllGather(layouts)
    bucket = Bucket(0, tuple(range(len(layouts))))

    @jax.custom_vjp
    def gathered(*slices):
        return tuple(_varying(x) for x in gather(bucket, list(slices)))

    def fwd(*slices):
        return gathered(*slices), None

    foreign = trace.foreign > 0

    def bwd(_, cts):
        if foreign:
            trace.twice(keys, sliced=True)
        return tuple(_scatter_back(trace, keys, layouts, cts))

    gathered.defvjp(fwd, bwd)
    return gathered


def gather_leaves(trace: SyncTrace, keys: Sequence, slices: Sequence,
                  layouts: Sequence[Layout]) -> list:
    """The whole parameters of stage-3 ``slices`` (this replica's, inside a step),
    in gather buckets of ``segment_broadcast_MB`` by their whole bytes, one dtype
    per bucket. ``keys`` name them (a gradient's name in ``check_nan_inf``'s
    errors)."""
    size = trace.shard.config.gather_bytes / MB
    whole = [jax.ShapeDtypeStruct(lay.shape, jnp.result_type(x))
             for x, lay in zip(slices, layouts)]
    plan = plan_leaves(whole, BucketConfig(size, size), by_dtype=True)

    def hook(bucket: Bucket, xs: list) -> Sequence:
        members = bucket.members
        lays = tuple(layouts[i] for i in members)
        if not any(map(is_differentiated, xs)):  # (read, not differentiated: invariant)
            return AllGather(lays)(Bucket(0, tuple(range(len(xs)))), xs)
        trace.wrapped_syncs += 1
        return _bucket_gather(trace, tuple(keys[i] for i in members), lays)(*xs)

    out = reduce_buckets(plan, list(slices), hook)
    trace.shard.whole.update(trace.hold(out))
    return out
