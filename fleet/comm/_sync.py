"""The wrapped model's gradient synchronisation: DDP's reducer hooks, in JAX.

Inside :func:`fleet.distributed_step` every piece of state enters the
per-device body *invariant* (``shard_map`` with ``check_vma=True``): the same
value on every replica, typed so. Wrapping a model attaches the reduction to
its parameters. When differentiated code reads a parameter of a wrapped model,
it reads it through an identity with a custom VJP: forward, the value is cast
to *varying*; backward, the local cotangent is averaged over the replicas
(``psum / N``) and comes back invariant. So the gradient any code computes for
a wrapped model's parameters -- ``nnx.grad``, ``jax.grad`` of a Linen
``apply``, a hand-written SGD -- is the global-batch gradient, the same on
every replica, and a plain ``nnx.Optimizer`` or optax transformation can use it.

The read goes through the parameter's type: wrapping turns each ``nnx.Param``
into a subclass whose ``get_value`` does the above (``isinstance(p, nnx.Param)``
still holds): :mod:`fleet.comm._synced`.

Buckets: the wrapped model's ``__call__`` (Linen: ``apply``) syncs all its
parameters at once, one custom-VJP call per bucket (:func:`fleet.comm._buckets.plan_buckets`),
so each bucket's all-reduce can start as soon as its gradients exist. A read
outside ``__call__`` (another method, a sub-module) syncs that one leaf.

Under ``no_sync`` the wrapped parameters enter the step varying, so their
gradients are local, with no communication: an optimizer that stepped on them
would give replicas different parameters, which the step refuses; the
distributed optimizer adds them to the accumulator instead of stepping. The
first synced step after it adds the accumulated gradient to its own local one
before the average: the sum of the local-mean gradients, averaged over
replicas, as in Paddle and torch DDP.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet._compat import is_differentiated
from fleet._errors import FleetError
from fleet.comm._buckets import Bucket, BucketConfig, plan_leaves, reduce_buckets
from fleet.comm._hooks import fleet_bucket, gradient_hook, zero_backward
from fleet.comm._param_gather import gather_leaves
from fleet.comm._trace import SyncTrace
from fleet.runtime._world import DATA_AXIS


def is_varying(x: Any) -> bool:
    """Whether ``x`` (inside a step) may differ across replicas (its vma type;
    outside ``shard_map`` the set of varying axes is empty). No fallback: were the
    field to move, this raises rather than call every gradient replicated."""
    return DATA_AXIS in jax.typeof(x).manual_axis_type.varying


def reduce_bucket(trace: SyncTrace, bucket: Bucket, keys: Sequence, cts: list,
                  wire: str | None) -> list:
    """A wrapped model's bucket of local gradients, reduced by this step's
    hook (:func:`fleet.comm._hooks.gradient_hook`); under ``strategy.sharding``
    by ZeRO's backward, which keeps slices and returns placeholders."""
    if trace.shard.config is not None:
        return zero_backward(trace, keys, cts)
    out = gradient_hook(wire, trace.tx.divisor)(bucket, cts)
    trace.finite.record([f"gradient of {k!r}" for k in keys], out)
    return out


class _Local(threading.local):
    """The calling thread's traces (:func:`current`, :func:`tracing`): fleet's one
    thread-local stack; what a trace needs (check_nan_inf's recorder, the metrics'
    updates) is a field of its :class:`fleet.comm._trace.SyncTrace`. And ``no_sync``'s
    depth."""

    no_sync = 0  # (a class default: read at every step call without a lookup that fails)


_local = _Local()


def current() -> SyncTrace | None:
    stack = getattr(_local, "traces", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def tracing(trace: SyncTrace) -> Iterator[SyncTrace]:
    stack = _local.__dict__.setdefault("traces", [])
    stack.append(trace)
    try:
        yield trace
    finally:
        stack.pop()


def no_sync_active() -> bool:
    """Whether the calling thread is inside ``no_sync``."""
    return _local.no_sync > 0


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """``no_sync``: a ``with`` block around step calls, as in Paddle and torch DDP; a
    flag of the calling thread, read when the step is called (the step compiles
    separately with and without it)."""
    if current() is not None:
        raise FleetError(
            "no_sync() was entered inside a distributed step; enter it around the call "
            "instead: `with model.no_sync(): loss = train_step(model, optimizer, x, y)`"
        )
    _local.no_sync += 1
    try:
        yield
    finally:
        _local.no_sync -= 1


#: Names of the ``jit`` calls that hold fleet's own collectives: the program guard
#: knows every other psum in a step is not fleet's (see fleet.step._decorator).
FLEET_CALLS = ("fleet_bucket", "fleet_psum", "fleet_pmean", "fleet_scatter", "fleet_gather",
               "fleet_batch_norm", "fleet_all_gather", "fleet_written")


@jax.jit
def fleet_psum(*leaves: Any) -> list:
    """``jax.lax.psum`` over ``data`` (fleet.all_reduce, broadcast), marked as fleet's."""
    return jax.lax.psum(list(leaves), DATA_AXIS)


def psum(leaves: list) -> list:
    return list(fleet_psum(*leaves))


@jax.jit
def fleet_written(x: Any) -> Any:
    """A value typed varying that every replica computed alike, typed the same on
    every replica: replica 0's, exactly (the others add zeros). A parameter a wrapped
    model's call wrote (``nnx.SpectralNorm`` writes the normalised kernel), state set
    from the parameters under ``no_sync``. The probe checks that it was computed from
    replicated values alone (fleet.step._probe_checks.check_written).

    Differentiated through (a kernel written by one call of the model and read by
    the next), it is the identity it stands for: each replica's gradient is the
    value's whole gradient, as on one device (the transpose of replica 0's value
    would give it to replica 0 alone, and the bucket's mean a 1/N of it)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _kept_alike(x)
    return _replica0(x)


def _replica0(x: Any) -> Any:
    first = jax.lax.axis_index(DATA_AXIS) == 0
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), DATA_AXIS)


@jax.custom_vjp
def _kept_alike(x: Any) -> Any:
    return _replica0(x)


def _kept_alike_fwd(x: Any) -> tuple:
    return _replica0(x), None


def _kept_alike_bwd(_: None, ct: Any) -> tuple:
    return (jax.lax.pcast(ct, DATA_AXIS, to="varying"),)


_kept_alike.defvjp(_kept_alike_fwd, _kept_alike_bwd)


@jax.jit
def fleet_pmean(*leaves: Any) -> list:
    """The mean over the replicas, as one call marked as fleet's (its result is the
    global value: fleet.semantics._outputs.check_counted)."""
    return [s / jax.lax.axis_size(DATA_AXIS) for s in jax.lax.psum(list(leaves), DATA_AXIS)]


def mean_over_replicas(leaves: list, wire: str | None = None) -> list:
    """Average of varying leaves over the replicas: one bucket."""
    return list(fleet_bucket(*leaves, wire=wire))


def _make_bucket_sync(bucket: Bucket, keys: tuple, wire: str | None):
    """A custom-VJP identity over one bucket of leaves (see the module docstring);
    backward, the trace's hook reduces the bucket."""

    @jax.custom_vjp
    def sync(*leaves):
        return tuple(jax.lax.pcast(x, DATA_AXIS, to="varying") for x in leaves)

    def fwd(*leaves):
        return sync(*leaves), None

    made_in = current()
    foreign = made_in is not None and made_in.foreign > 0

    def bwd(_, cts):
        # (outside a step, an empty trace: nothing to add, divide or check)
        trace = current() or SyncTrace(num_replicas=0)
        if foreign:
            trace.twice(keys)
        cts = [ct if is_varying(ct) else jax.lax.pcast(ct, DATA_AXIS, to="varying") for ct in cts]
        return tuple(reduce_bucket(trace, bucket, keys, trace.accum.take(keys, cts), wire))

    sync.defvjp(fwd, bwd)
    return sync


def sync_leaves(keys: Sequence, leaves: Sequence, buckets: BucketConfig,
                layouts: Sequence | None = None) -> list:
    """The leaves, each through its bucket's custom-VJP sync (differentiated leaves
    only; others pass through). ``keys`` name the leaves for the accumulator.
    ``layouts``: stage 3's parameters (a layout, else ``None``) are slices,
    gathered whether differentiated or not (:mod:`fleet.comm._param_gather`).

    A value is synced once per trace (``trace.synced``, by its id): a second read
    of it -- the model called twice, a weight decay term read outside
    ``__call__`` -- gets the same synced value, so JAX adds its cotangents
    before the one reduction. (Two syncs would each add what ``no_sync``
    accumulated for the parameter, and under sharding each would leave its own
    slice for one gradient.)"""
    trace = current()
    if trace is None:
        return list(leaves)
    known = [trace.synced.get(id(x)) for x in leaves]
    layouts = list(layouts or [None] * len(leaves))
    sliced = [i for i, lay in enumerate(layouts) if lay is not None and known[i] is None]
    todo = [i for i, x in enumerate(leaves) if known[i] is None and layouts[i] is None
            and is_differentiated(x) and not is_varying(x)
            and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    out = list(leaves)
    if sliced:
        whole = gather_leaves(trace, [keys[i] for i in sliced], [leaves[i] for i in sliced],
                              [layouts[i] for i in sliced])
        for i, x in zip(sliced, whole):
            out[i] = x
    if todo:
        def synced(bucket: Bucket, xs: list) -> Sequence:
            trace.wrapped_syncs += 1
            keyed = tuple(keys[i] for i in bucket.members)
            return _make_bucket_sync(bucket, keyed, buckets.wire_dtype)(*xs)

        out = reduce_buckets(plan_leaves(leaves, buckets, todo), out, synced)
    made = sliced + todo
    for i, x in zip(made, trace.hold([leaves[i] for i in made])):
        trace.synced[x] = out[i]
    return [x if k is None else k for x, k in zip(out, known)]


class PerReplica:
    """Mixin of state variables each replica holds its own part of: a global
    array of shape ``(replicas, ...)`` sharded over ``data``; inside the step,
    the replica's row (varying)."""

    __slots__ = ()


class GradAccumulator(PerReplica, nnx.Variable):
    """Per-replica gradients accumulated under ``no_sync`` (a distributed
    optimizer's ``grad_accum``): a global array of shape ``(replicas, *param)``,
    sharded over ``data``, so each replica holds its own local sum. Part of the
    optimizer's state: a checkpoint taken between ``no_sync`` steps carries it."""


def accumulator_key(key: str) -> str:
    """The ``grad_accum`` entry of the parameter ``key`` (dots are not attributes)."""
    return key.replace(".", ":")


def accumulate(grads: dict[str, Any]) -> None:
    """Under ``no_sync``: adds the local gradients (varying), by their parameters'
    names in the wrapped model, to the accumulator (the distributed optimizer
    calls it instead of stepping)."""
    trace = current()
    for key, g in grads.items():
        if is_varying(g):
            trace.accum.add(key, g)
