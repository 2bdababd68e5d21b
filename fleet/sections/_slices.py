"""Whole-tensor reductions of parameter slices, completed across the replicas.

Under ``strategy.sharding`` each replica runs the optimizer's update on its
slice of every parameter-shaped array (:mod:`fleet.sections._sharding`). Elementwise
math on a slice is the slice of the whole result; a reduction over a whole
tensor is not: LAMB's and LARS's trust ratios and ``optax.clip_by_global_norm``
need the norm of the whole parameter or gradient, and a slice has only its part.

:func:`run` completes them without touching optax. It traces the update to a
jaxpr (``jax.make_jaxpr``) and evaluates it equation by equation, following
which values are slices: the inputs named as slices are, and so is every value
computed from one that keeps an array's shape. A ``reduce_sum`` over every axis
of a slice, or a ``dot_general`` contracting two slices over every axis (a
``vdot``), is a partial sum: it is summed over the slices of the shard group
(``psum``), and its result is the whole tensor's value, the same on every
replica. Slices are padded with zeros, which add nothing to such sums.

Anything else computed from a slice (a maximum, a partial reduction, an
element picked by position) stays per replica. It is not made right here: the
probe (:func:`fleet.sections._shard_probe.verify`) compares the sliced update with the
whole one before the first step and refuses an optimizer that differs.

Calls inside the update (``jax.jit``, ``custom_jvp`` / ``custom_vjp``
functions, such as ``jnp.linalg.norm``) are evaluated the same way, inside.
Loops and conditionals run as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.extend.core import primitives as prims

#: Primitives whose jaxpr is evaluated inline (by its parameter name).
_CALLS = {prims.jit_p: "jaxpr", prims.closed_call_p: "call_jaxpr",
          prims.custom_jvp_call_p: "call_jaxpr", prims.custom_vjp_call_p: "call_jaxpr"}


def run(fn: Callable, args: Sequence[Any], sliced: Sequence[Any],
        total: Callable[[Any], Any]) -> Any:
    """``fn(*args)`` with its whole-tensor sums of slices completed by ``total``.

    Args:
        fn: a function of ``args`` (pytrees of arrays), such as an optax update.
        args: its arguments.
        sliced: for each argument, a pytree of its structure (or a prefix of it)
            of booleans: which leaves are slices.
        total: the sum of a per-replica partial value over the shard group.

    Returns:
        What ``fn(*args)`` returns, with every whole-tensor ``reduce_sum`` /
        ``vdot`` of a slice replaced by its total.
    """
    marks = jax.tree.leaves(jax.tree.map(
        lambda m, a: jax.tree.map(lambda _: bool(m), a), tuple(sliced), tuple(args)))
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs, _ = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), marks, total)
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], marks: Sequence[bool],
          total: Callable[[Any], Any]) -> tuple[list, list[bool]]:
    env: dict[Any, tuple[Any, bool]] = {}

    def read(v):
        return (v.val, False) if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = (x, False)
    for v, x, m in zip(jaxpr.invars, args, marks):
        env[v] = (x, m)
    for eqn in jaxpr.eqns:
        got = [read(v) for v in eqn.invars]
        values = [x for x, _ in got]
        flags = [m for _, m in got]
        if eqn.primitive in _CALLS and isinstance(eqn.params.get(_CALLS[eqn.primitive]),
                                                  core.ClosedJaxpr):
            inner = eqn.params[_CALLS[eqn.primitive]]
            outs, out_flags = _eval(inner.jaxpr, inner.consts, values, flags, total)
        else:
            out = eqn.primitive.bind(*values, **eqn.params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
            if _whole_sum(eqn, flags):
                outs, out_flags = [_typed_like(total(outs[0]), outs[0])], [False]
            else:
                out_flags = [any(flags) and len(v.aval.shape) > 0 for v in eqn.outvars]
        for v, x, m in zip(eqn.outvars, outs, out_flags):
            if not isinstance(v, core.DropVar):
                env[v] = (x, m)
    result = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in result], [m for _, m in result]


def _typed_like(x: Any, ref: Any) -> Any:
    """``x`` typed as varying over the mesh axes ``ref`` varies over: the rest of
    the jaxpr was traced with the partial sum's type (its value is now the same
    on every replica)."""
    missing = tuple(sorted(set(jax.typeof(ref).manual_axis_type.varying)
                           - set(jax.typeof(x).manual_axis_type.varying)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _whole_sum(eqn: Any, flags: Sequence[bool]) -> bool:
    """A sum over every element of a slice: ``reduce_sum`` over all axes of one,
    or a ``dot_general`` of two slices contracting all their axes."""
    if eqn.primitive is prims.reduce_sum_p:
        ndim = len(eqn.invars[0].aval.shape)
        return flags[0] and ndim > 0 and len(eqn.params["axes"]) == ndim
    if eqn.primitive is prims.dot_general_p and all(flags):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = (len(v.aval.shape) for v in eqn.invars)
        return not lb and not rb and len(lc) == lhs > 0 and len(rc) == rhs
    return False
