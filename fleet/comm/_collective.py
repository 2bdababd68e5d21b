"""Paddle-style collectives: ``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``.

Inside a :func:`fleet.distributed_step` they work across the data-parallel
*replicas* (devices) with ``jax.lax`` collectives over the ``data`` axis.
Outside a step they work across *processes* (workers) on host values, through
``jax.experimental.multihost_utils``; with one process they return their input.
There they are collective: every process must make the call, and one that does
not is named after at most ``FLEET_AGREE_TIMEOUT`` seconds (60).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from fleet._errors import FleetConfigError
from fleet.comm import _sync
from fleet.runtime._agree import join
from fleet.runtime._world import DATA_AXIS, wait_for_all

_OPS = ("sum", "max", "min", "avg", "prod")


def _in_step() -> bool:
    return _sync.current() is not None


def all_reduce(x: Any, op: str = "sum") -> Any:
    """Reduces ``x`` (a pytree) with ``op`` in ``{'sum', 'max', 'min', 'avg', 'prod'}``.

    Example:
        >>> correct = fleet.all_reduce((pred == y).sum())  # doctest: +SKIP
    """
    if op not in _OPS:
        raise FleetConfigError(f"all_reduce op={op!r} is not one of {_OPS}")
    if _in_step():
        leaves, treedef = jax.tree_util.tree_flatten(x)
        plain = functools.partial(_reduce_in_step, op=op)
        if any(_sync.is_varying(v) and jnp.issubdtype(jnp.result_type(v), jnp.inexact)
               for v in leaves):
            return jax.tree_util.tree_unflatten(treedef, _global_adjoint(plain, leaves))
        return jax.tree_util.tree_unflatten(treedef, plain(leaves))
    if jax.process_count() == 1:
        return x
    reduce = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean, "prod": np.prod}[op]
    return jax.tree.map(lambda v: reduce(v, axis=0), _process_allgather(x))


def _reduce_in_step(leaves: list, op: str) -> list:
    if op == "prod":
        return [jnp.prod(jax.lax.all_gather(v, DATA_AXIS), axis=0) for v in leaves]
    if op == "avg":
        return _sync.fleet_pmean(*leaves)
    if op == "sum":
        return _sync.psum(leaves)
    fn = {"max": jax.lax.pmax, "min": jax.lax.pmin}[op]
    return [fn(v, DATA_AXIS) for v in leaves]


def _global_adjoint(plain: Callable, leaves: list) -> list:
    """``plain(leaves)`` (a reduction over the replicas) with the backward pass of
    the *global* computation, the one the single-device step differentiates.

    fleet averages a wrapped model's gradients over the replicas: each replica's
    cotangent stands for its share of the global gradient, times N. JAX's own
    transpose of a reduction gives each replica its own share only (the
    cotangent, pvary'd, divided by N for a mean): a gradient through
    ``all_reduce(loss, 'avg')`` would come out N times too small. Here each
    replica gets the cotangent of every replica's use of the reduced value (a
    psum of the cotangent; a cotangent the same on every replica is that times
    N), then the reduction's own transpose: with fleet's average, the global
    gradient."""
    @jax.custom_vjp
    def reduce(leaves):
        return plain(leaves)

    def fwd(leaves):
        return plain(leaves), leaves

    def bwd(leaves, cts):
        n = jax.lax.axis_size(DATA_AXIS)
        cts = [_sync.psum([ct])[0] if _sync.is_varying(ct) else ct * jnp.asarray(n, ct.dtype)
               for ct in cts]
        return jax.vjp(plain, leaves)[1](cts)

    reduce.defvjp(fwd, bwd)
    return reduce(leaves)


def broadcast(x: Any, src: int = 0) -> Any:
    """Every replica (in a step) or process (outside) gets ``src``'s ``x``."""
    if _in_step():
        def pick(v):
            mask = jax.lax.axis_index(DATA_AXIS) == src
            return _sync.psum([jnp.where(mask, v, jnp.zeros_like(v))])[0]

        return jax.tree.map(pick, x)
    if jax.process_count() == 1:
        return x
    join("fleet.broadcast (outside a step)")
    return multihost_utils.broadcast_one_to_all(x, is_source=jax.process_index() == src)


def all_gather(x: Any) -> Any:
    """Stacks every replica's (in a step) or process's (outside) ``x`` on a new
    leading axis, in replica / process order."""
    if _in_step():  # the same result on every replica: typed invariant
        return fleet_all_gather(x)
    if jax.process_count() == 1:  # (traced: a single-device script's jit of the same step)
        return jax.tree.map(lambda v: (v if isinstance(v, jax.core.Tracer) else np.asarray(v))[None],
                            x)
    return _process_allgather(x)


@jax.jit
def fleet_all_gather(x: Any) -> Any:
    """``jax.lax.all_gather`` over ``data``, marked as fleet's (``_sync.FLEET_CALLS``):
    the sum over replicas in its backward pass (the cotangent of a value the same on
    every replica, used with each replica's rows) is the global computation's, not
    one of JAX's that multiplies a gradient by N (a contrastive loss against every
    replica's rows trains as on one device)."""
    return jax.lax.all_gather(x, DATA_AXIS, to="invarying")


def _process_allgather(x: Any) -> Any:
    join("fleet.all_reduce / all_gather (outside a step)")
    return multihost_utils.process_allgather(x, tiled=False)


def barrier() -> None:
    """Waits for every process (:func:`fleet.barrier_worker`). Inside a step it does
    nothing: replicas run in lockstep there."""
    if not _in_step():
        wait_for_all("fleet.barrier")
