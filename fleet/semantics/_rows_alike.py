"""Every replica's rows, gathered and kept as state (a MoCo queue), against the
single-device step (:func:`fleet.semantics._outputs.check_counted`).

MoCo enqueues each step's keys, every replica's, gathered:
``queue = jnp.concatenate([fleet.all_gather(k).reshape(-1, d), queue])[:size]``.
On the replicas the gathered keys are the global batch's, in batch order, the
same on every replica; in the single-device step (one replica) the gather puts
the keys on a new axis of one and the reshape takes it off: the same rows, where
the keys are each row's own, computed from that row alone. The state then
equals one device's, though the two traces' shapes differ in the rows (each
replica's ``b`` against the reference's ``N * b``).

:func:`gathered_rows` finds such a pair (the replica's reshape of a gather, the
reference's of its gather over one replica); :func:`alike_rows` follows the two
operands back side by side: the same operations, of operations that keep each
row's value its own and the rows on the leading axis (element by element, a
product over the features, a reduction over other axes, a layout change), each
shape the other's but for the rows. Values without the rows (the parameters)
must be the same in both traces (the walk's :meth:`same`); anything else (a
reduction over the rows, a sort, a slice, random bits, ``jnp.arange`` over the
rows) is not alike, and check_counted refuses the state.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal

from fleet.semantics._jaxpr_scope import CALLS, ELEMENTWISE, all_of

GATHER = "fleet_all_gather"  # (fleet.comm._collective)
_LAYOUT = frozenset(("reshape", "squeeze", "expand_dims"))
_OTHER_AXES = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                         "argmin"))


def gathered_rows(ea: Any, sa: Any, eb: Any, sb: Any) -> tuple | None:
    """``(operand, its scope, operand, its scope, replicas)`` where ``ea`` is the
    replica's reshape of ``fleet.all_gather``'s rows onto one axis and ``eb`` the
    reference's (one replica's), else None."""
    if ea.primitive.name != "reshape" or eb.primitive.name != "reshape":
        return None
    ga, gb = sa.producer.get(id(ea.invars[0])), sb.producer.get(id(eb.invars[0]))
    if (ga is None or gb is None or ga.params.get("name") != GATHER
            or gb.params.get("name") != GATHER):
        return None
    k = ga.outvars.index(ea.invars[0])
    if gb.outvars.index(eb.invars[0]) != k:
        return None
    shape_a, shape_b = ga.outvars[k].aval.shape, gb.outvars[k].aval.shape
    out_a, out_b = ea.outvars[0].aval.shape, eb.outvars[0].aval.shape
    if (out_a != out_b or len(shape_a) < 2 or shape_b[0] != 1
            or out_a[:1] != (shape_a[0] * shape_a[1],) or out_a[1:] != shape_a[2:]):
        return None
    return ga.invars[k], sa, gb.invars[k], sb, shape_a[0]


def _scaled(a: tuple, b: tuple, n: int) -> bool:
    """Whether shape ``b`` is ``a`` with ``n`` times the rows on its leading axis."""
    return len(a) == len(b) >= 1 and a[1:] == b[1:] and a[0] * n == b[0]


def _keeps_rows(eqn: Any, scaled: list) -> bool:
    """Whether ``eqn`` keeps each row its own on the leading axis; ``scaled``: which
    of its inputs hold the rows there."""
    name, p = eqn.primitive.name, eqn.params
    if name in ELEMENTWISE or name in _LAYOUT:
        return True
    if name in _OTHER_AXES:
        return 0 not in tuple(p.get("axes", ()))
    if name == "transpose":
        return p["permutation"][0] == 0
    if name == "concatenate":
        return p["dimension"] != 0
    if name == "broadcast_in_dim":
        return not scaled[0] or p["broadcast_dimensions"][:1] == (0,)
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        if scaled[1]:
            return tuple(lb[:1]) == tuple(rb[:1]) == (0,)
        return tuple(lb[:1]) == (0,) or (not lb and 0 not in lc)
    return False


def alike_rows(walk: Any, a: Any, sa: Any, b: Any, sb: Any, n: int) -> bool:
    """Whether ``a`` (the replica's) holds its rows of what ``b`` (the reference's,
    with ``n`` times the rows) holds for the global batch, each row's value its own.
    Each pair is followed once (``walk.alike_memo``: a residual network's values
    meet again and again on the way back), in a loop (:func:`all_of`: a deep
    encoder's chain is thousands long)."""
    return all_of((a, sa, b, sb), lambda p: (id(p[0]), id(p[2])),
                  lambda *p: _alike(walk, *p, n), walk.alike_memo)


def _alike(walk: Any, a: Any, sa: Any, b: Any, sb: Any, n: int) -> bool | list:
    """Whether ``a`` and ``b`` are alike, when that is known from them; else the
    pairs ``(x, sx, y, sy)`` they are alike exactly when all of them are."""
    if isinstance(a, Literal) or isinstance(b, Literal) or a.aval.shape == b.aval.shape:
        return walk.same(a, sa, b, sb)
    if not _scaled(a.aval.shape, b.aval.shape, n):
        return False
    if id(a) in sa.inputs or id(b) in sb.inputs:
        if id(a) not in sa.inputs or id(b) not in sb.inputs:
            return False
        if sa.parent is None or sb.parent is None:  # the body's inputs: the batch
            return sa.parent is sb.parent is None and sa.inputs[id(a)] == sb.inputs[id(b)]
        return [(sa.parent[0][sa.inputs[id(a)]], sa.parent[1],
                 sb.parent[0][sb.inputs[id(b)]], sb.parent[1])]
    ea, eb = sa.producer.get(id(a)), sb.producer.get(id(b))
    if (ea is None or eb is None or ea.primitive != eb.primitive
            or len(ea.invars) != len(eb.invars) or ea.outvars.index(a) != eb.outvars.index(b)):
        return False
    k = ea.outvars.index(a)
    if ea.primitive.name in CALLS:
        ga, gb = sa.inner(ea), sb.inner(eb)
        return ga is not None and gb is not None and [
            (ga[1].outvars[k], ga[0], gb[1].outvars[k], gb[0])]
    scaled = [not isinstance(x, Literal) and _scaled(x.aval.shape, y.aval.shape, n)
              for x, y in zip(ea.invars, eb.invars)]
    return _keeps_rows(ea, scaled) and [(x, sa, y, sb) for x, y in zip(ea.invars, eb.invars)]
