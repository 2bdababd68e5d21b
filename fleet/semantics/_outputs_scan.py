"""Scans in the outputs' walk (:class:`fleet.semantics._outputs_walk.Walk`): a
scan's carry (gradients or a loss accumulated over micro-batches), its stacked
outputs reduced over the iterations (``losses.mean()``), and whether a scan's
output is computed alike in the replica's trace and the reference trace.

Each takes the walk and both traces' scan equations (``ea`` in scope ``sa``, the
replica's; ``eb`` in ``sb``, the reference's), and answers as the walk's
methods do: a kind, or None with the walk's reason (``walk.fail``)."""

from __future__ import annotations

from typing import Any

from fleet._compat import scan_counts
from fleet.semantics._jaxpr_scope import Scope

#: :func:`stacked_kind`'s answer where the operand is not stacked by a scan
NOT_STACKED = ("not stacked",)


def _bodies(ea: Any, sa: Scope, eb: Any, sb: Scope) -> tuple[list, list]:
    """Both scans' bodies: their scopes (inputs from the scans' operands) and jaxprs."""
    scopes = [Scope(e.params["jaxpr"], (e.invars, s)) for e, s in ((ea, sa), (eb, sb))]
    inner = [getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"]) for e in (ea, eb)]
    return scopes, inner


def same_carry(walk: Any, ea: Any, sa: Scope, eb: Any, sb: Scope, i: int) -> bool:
    """Whether a ``scan``'s output ``i`` is computed alike in both traces: for a
    carry, the same number of iterations and the same update from the same
    initial value (a count of rows added each iteration differs; an RNG count
    or a step counter does not). A stacked output is taken as the same."""
    shape = [(e.params["length"], *scan_counts(e.params)) for e in (ea, eb)]
    if i >= shape[0][2]:
        return True
    if shape[0] != shape[1]:
        return False
    scopes, inner = _bodies(ea, sa, eb, sb)
    return walk.same(inner[0].outvars[i], scopes[0], inner[1].outvars[i], scopes[1])


def scan_kind(walk: Any, ea: Any, sa: Scope, eb: Any, sb: Scope, i: int, depth: int) -> Any:
    """A ``scan``'s carry ``i`` (accumulation over micro-batches): the kind the
    loop leaves it, from its initial value's and one iteration's, to a fixed point
    (``0.0`` plus a mean each iteration is a mean). A stacked output is refused
    here: reduced over the iterations, :func:`stacked_kind` takes it."""
    (consts, carries), (_, other) = scan_counts(ea.params), scan_counts(eb.params)
    if i >= carries or other != carries:
        return walk.fail("a value stacked by a scan, other than summed or averaged over its "
                         "iterations (losses.mean())")
    scopes, inner = _bodies(ea, sa, eb, sb)
    got = walk.kind(ea.invars[consts + i], sa, eb.invars[consts + i], sb, depth + 1)
    for _ in range(3):
        if got is None:
            return None
        for j in range(carries):  # this carry as the loop left it; another: refused
            walk.carries[(id(inner[0].invars[consts + j]), id(scopes[0]))] = (
                got if j == i else "a scan carry read by another")
        again = walk.kind(inner[0].outvars[i], scopes[0], inner[1].outvars[i], scopes[1],
                          depth + 1)
        if again == got:
            return got
        got = again
    return walk.fail("a scan carry that does not settle")


def stacked_kind(walk: Any, xa: Any, sa: Scope, xb: Any, sb: Scope, depth: int) -> Any:
    """The kind of each iteration's value, where a reduction's operand (``xa`` in
    the replica's trace, ``xb`` in the reference's) is stacked by a scan of the
    same length in both (``losses.mean()`` of a scan over micro-batches), from the
    scanned inputs alone: a value read from a carry is refused (rows carried, as
    a hidden state, are reduced over before); else :data:`NOT_STACKED`."""
    ea, eb = sa.producer.get(id(xa)), sb.producer.get(id(xb))
    if ea is None or eb is None or ea.primitive.name != "scan" or eb.primitive.name != "scan":
        return NOT_STACKED
    (consts, carries), i = scan_counts(ea.params), ea.outvars.index(xa)
    if (i < carries or scan_counts(eb.params)[1] != carries or eb.outvars.index(xb) != i
            or ea.params["length"] != eb.params["length"]):
        return NOT_STACKED
    scopes, inner = _bodies(ea, sa, eb, sb)
    for j in range(carries):
        walk.carries[(id(inner[0].invars[consts + j]), id(scopes[0]))] = (
            "a value stacked by a scan, computed from its carry")
    return walk.kind(inner[0].outvars[i], scopes[0], inner[1].outvars[i], scopes[1], depth + 1)
