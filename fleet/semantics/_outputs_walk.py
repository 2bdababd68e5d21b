"""The side-by-side walk of ``fleet.semantics._outputs``: a scalar output followed back
through the replica's trace and the reference trace (the same step with more
rows) to the reduction over the batch rows that made it. See ``fleet.semantics._outputs``
for the rules; this module applies them op by op (:class:`Walk`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from jax.extend.core import Literal

from fleet.semantics._jaxpr_scope import (
    CALLS,
    KEEPS_VALUE,
    ReplicaConstant,
    Scope,
    all_reduced,
    is_varying_var,
    user_line,
    uses_all_reduce,
)
from fleet.semantics._outputs_same import same
from fleet.semantics._outputs_scan import NOT_STACKED, scan_kind, stacked_kind

MEAN, SUM, MAX, MIN = "mean", "sum", "max", "min"
_FLIP = {MAX: MIN, MIN: MAX, MEAN: MEAN, SUM: SUM}
_SAME = tuple(op for op in KEEPS_VALUE if op != "convert_element_type")
_REDUCTIONS = {"reduce_sum": SUM, "reduce_max": MAX, "reduce_min": MIN,
               "reduce_or": MAX, "reduce_and": MIN}
_OPS = (*_SAME, "convert_element_type", "neg", "add", "sub", "mul", "div", "max", "min")
_DEPTH = 400
#: what an equation no combination follows is, in the words of the code that makes it
_SAID = {
    "gather": "an indexing: x[i], jnp.take, the middle rows jnp.median picks",
    "sort": "a sort: jnp.sort, jnp.median, jnp.quantile",
    "dynamic_slice": "a slice at a position the step computes",
    "cumsum": "a cumulative sum",
    "argmax": "an index of the rows, not a value from them",
    "argmin": "an index of the rows, not a value from them",
    "top_k": "jax.lax.top_k",
    "select_n": "a choice between values: jnp.where",
}
_MEAN_COUNT = ("fleet.all_reduce(mask.sum(), 'avg'), the replicas' mean count, and the "
               "replicas' mean of the ratio is the single-device one")
_RATIO = "a sum over the rows divided by another: a mean weighted by a mask? Divide by " + _MEAN_COUNT
_GUARDED = "a sum over the rows {how}: the count of a masked mean? Divide the masked sum by " + _MEAN_COUNT
#: ``fleet.all_reduce``'s 'avg' and 'sum' (fleet.comm._sync): each one's value against
#: the reference's, from its operand's (:meth:`Walk.kind`'s results; a constant as
#: ``("c",)``). The mean over N replicas of a sum over each one's rows grows with the
#: rows like a row count (the divisor that makes a masked sum a mean); their sum is
#: the global value; the sum of N means (or constants) is N times the reference's.
_OVER_REPLICAS = {
    "fleet_pmean": {("k", SUM): ("up",), ("up",): ("up",), ("k", MEAN): ("c", None),
                    ("c",): ("c", None), ("down",): ("down",)},
    "fleet_psum": {("k", SUM): ("c", None), ("up",): ("c", None), ("k", MEAN): ("down",),
                   ("c",): ("down",)},
}


def _a(word: str) -> str:
    """The article for ``word``: "an" before a vowel (an integer_pow, an exp)."""
    return "an" if word[:1] in "aeiou" else "a"


class _Made(NamedTuple):
    """A value and its reference, with the equations that made them (:meth:`Walk._leaf`)."""
    a: Any
    ea: Any
    sa: Scope
    eb: Any
    sb: Scope


class Walk:
    """The side-by-side walk of the replica's trace and the reference trace
    (``scale`` times the rows). Results: ``("k", kind)`` a varying value of that
    kind, ``("c", value or None)`` a constant (the same in both traces),
    ``("up",)`` / ``("down",)`` a literal that grows (a row count) or shrinks
    (its reciprocal) with the rows, or ``None``."""

    def __init__(self, scale: int, summed_loss: bool = False, replicas: int | None = None):
        self.scale = scale
        #: the replicas the probe ran on (``scale`` unless one: then twice its rows)
        self.replicas = scale if replicas is None else replicas
        #: check_summed_loss's walk: a sum plus a constant is a sum (its gradient is
        #: the sum's), where an output's walk refuses it (no combination gives it)
        self.summed_loss = summed_loss
        self.replica_constant = ReplicaConstant()
        self.memo, self.same_memo = {}, {}
        self.alike_memo: dict = {}  # (fleet.semantics._rows_alike)
        self.why = "its computation"
        #: (id(scan body's carry input), id(its scope)) -> its kind, or why it is refused
        self.carries: dict = {}
        self.global_calls: tuple = ()  # calls whose results :meth:`same` takes as equal
        #: :meth:`same` met fleet.all_gather's rows, not each row's own value
        self.gathered_unlike = False

    def fail(self, why: str) -> None:
        self.why = why
        return None

    def value(self, v: Any, s: Scope, depth: int = 0) -> float | None:
        """The value of a scalar computed from literals alone, else None."""
        key = (id(v), id(s))
        if key not in self.memo:
            self.memo[key] = None if depth > 50 else self._value(v, s, depth)
        return self.memo[key]

    def _value(self, v: Any, s: Scope, depth: int) -> float | None:
        if isinstance(v, Literal):
            return float(np.asarray(v.val)) if np.ndim(v.val) == 0 else None
        if id(v) in s.consts:
            c = np.asarray(s.consts[id(v)])
            return float(c) if c.ndim == 0 or c.size == 1 and np.all(c == c.flat[0]) else None
        if id(v) in s.inputs:
            if s.parent is None:
                return None
            invars, outer = s.parent
            return self.value(invars[s.inputs[id(v)]], outer, depth + 1)
        eqn = s.producer.get(id(v))
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name in CALLS:
            got = s.inner(eqn)
            if got is None:
                return None
            scope, inner = got
            return self.value(inner.outvars[eqn.outvars.index(v)], scope, depth + 1)
        args = []
        for x in eqn.invars:
            args.append(self.value(x, s, depth + 1))
            if args[-1] is None:
                return None
        ops = {"neg": lambda a: -a, "add": lambda a, b: a + b, "sub": lambda a, b: a - b,
               "mul": lambda a, b: a * b, "max": max, "min": min,
               "div": lambda a, b: a / b if b else math.nan}
        if name in _SAME or name == "convert_element_type":
            return args[0] if len(args) == 1 else None
        return ops[name](*args) if name in ops and len(args) in (1, 2) else None

    def same(self, a: Any, sa: Scope, b: Any, sb: Scope) -> bool:
        """Whether two invariant values are computed alike from the same inputs
        (:func:`fleet.semantics._outputs_same.same`)."""
        return same(self, a, sa, b, sb)

    def kind(self, a: Any, sa: Scope, b: Any, sb: Scope, depth: int = 0) -> tuple | None:
        got = self._leaf(a, sa, b, sb, depth)
        return self._made(*got, depth) if isinstance(got, _Made) else got

    def _leaf(self, a: Any, sa: Scope, b: Any, sb: Scope, depth: int) -> tuple | None:
        """:meth:`kind`, where it is known before the equations that made ``a`` and
        ``b`` are looked into; else those (:class:`_Made`)."""
        if depth > _DEPTH:
            return self.fail("too deep to follow")
        if (id(a), id(sa)) in self.carries:  # a scan's carry, as the loop leaves it so far
            got = self.carries[(id(a), id(sa))]
            return self.fail(got) if isinstance(got, str) else got
        va, vb = self.value(a, sa), self.value(b, sb)
        if va is not None and vb is not None:
            if va == vb:
                return ("c", va)
            if va and math.isclose(vb / va, self.scale, rel_tol=1e-6):
                return ("up",)
            if vb and math.isclose(va / vb, self.scale, rel_tol=1e-6):
                return ("down",)
            return self.fail("a constant that depends on the batch size")
        if isinstance(a, Literal) or isinstance(b, Literal):
            return self.fail("a constant that depends on the batch size")
        reduced = [all_reduced(a, sa), all_reduced(b, sb)]
        if reduced != [None, None]:
            return self._over_replicas(*reduced, depth)
        if not is_varying_var(a):
            if not is_varying_var(b) and self.same(a, sa, b, sb):
                return ("c", None)
            if is_varying_var(b) or not uses_all_reduce(a, sa):
                return self.fail("a value computed from the batch's shape")
            # (a global value computed from fleet.all_reduce's: followed op by op)
        if self.replica_constant(a, sa) and (self.summed_loss or (
                self.replica_constant(b, sb) and self.same(a, sa, b, sb))):
            # Typed varying, the same on every replica: a term of the parameters read
            # as variable[...]. An output's walk needs it computed alike in both traces
            # (not scaled by the row count); to find a summed loss, any such term will do.
            return ("c", None)
        if id(a) in sa.inputs or id(b) in sb.inputs:
            if id(a) not in sa.inputs or id(b) not in sb.inputs or sa.parent is None:
                return self.fail("a value the step gets, not one it reduces")
            if sb.parent is None:
                return self.fail("the two traces differ")
            return self.kind(sa.parent[0][sa.inputs[id(a)]], sa.parent[1],
                             sb.parent[0][sb.inputs[id(b)]], sb.parent[1], depth + 1)
        ea, eb = sa.producer.get(id(a)), sb.producer.get(id(b))
        if (ea is None or eb is None or ea.primitive != eb.primitive
                or len(ea.invars) != len(eb.invars) or ea.outvars.index(a) != eb.outvars.index(b)):
            return self.fail("the step computes it differently for other batch sizes")
        return _Made(a, ea, sa, eb, sb)

    def _made(self, a: Any, ea: Any, sa: Scope, eb: Any, sb: Scope, depth: int) -> tuple | None:
        """:meth:`kind` of ``a`` (and its reference), from the equations that made them."""
        name = ea.primitive.name
        if name in ("add", "sub"):
            return self._terms(ea, sa, eb, sb, depth)
        if name == "scan":
            return scan_kind(self, ea, sa, eb, sb, ea.outvars.index(a), depth)
        if name in CALLS:
            ga, gb = sa.inner(ea), sb.inner(eb)
            if ga is None or gb is None:
                return self.fail(f"{_a(name)} {name} fleet cannot look into")
            i = ea.outvars.index(a)
            return self.kind(ga[1].outvars[i], ga[0], gb[1].outvars[i], gb[0], depth + 1)
        if name in _REDUCTIONS:
            return self._reduction(name, ea, sa, eb, sb, depth)
        if name == "select_n":  # (a guard, jnp.where(jnp.isnan(m), 0.0, m): its cases' reasons first)
            for x, y in zip(ea.invars[1:], eb.invars[1:]):
                if self.kind(x, sa, y, sb, depth + 1) is None:
                    return None
        if name not in _OPS:
            where = user_line(ea, sa)
            return self.fail(f"{_a(name)} {name}" + (f" at {where}" if where else "") + (
                f", {_SAID[name]}" if name in _SAID else ""))
        args = [self.kind(x, sa, y, sb, depth + 1) for x, y in zip(ea.invars, eb.invars)]
        if any(r is None for r in args):
            return None
        return self._op(name, ea, args)

    def _terms(self, ea: Any, sa: Scope, eb: Any, sb: Scope, depth: int) -> tuple | None:
        """An ``add`` or ``sub`` whose first operand may be one too, and so on (Python's
        ``sum`` of a deep model's per-layer terms): that chain followed in a loop, each
        term as deep as the first, in :meth:`kind`'s order."""
        chain = [(ea, eb)]
        while True:
            first = self._leaf(chain[-1][0].invars[0], sa, chain[-1][1].invars[0], sb, depth + 1)
            if not (isinstance(first, _Made) and first.ea.primitive.name in ("add", "sub")):
                break
            chain.append((first.ea, first.eb))
        got = self._made(*first, depth + 1) if isinstance(first, _Made) else first
        for ea, eb in reversed(chain):
            second = self.kind(ea.invars[1], sa, eb.invars[1], sb, depth + 1)
            got = None if got is None or second is None else self._op(ea.primitive.name, ea,
                                                                       [got, second])
        return got

    def _over_replicas(self, ra: tuple | None, rb: tuple | None, depth: int) -> tuple | None:
        """The value of ``fleet.all_reduce(x, 'avg' or 'sum')`` in both traces
        (``(call, x, its scope)`` each), from ``x``'s kind: :data:`_OVER_REPLICAS`."""
        if ra is None or rb is None or ra[0] != rb[0]:
            return self.fail("the step computes it differently for other batch sizes")
        inner = self.kind(ra[1], ra[2], rb[1], rb[2], depth + 1)
        if inner is None:
            return None
        call = "fleet_pmean" if self.replicas == 1 else ra[0]
        got = _OVER_REPLICAS[call].get(inner[:1] if inner[0] == "c" else inner)
        if got is None:
            op = "mean" if ra[0] == "fleet_pmean" else "sum"
            return self.fail(f"fleet.all_reduce's {op} over the replicas of a "
                              f"{inner[1] if inner[0] == 'k' else 'count of rows'}")
        return ("c", inner[1]) if got == ("c", None) and inner[0] == "c" else got

    def _reduction(self, name, ea, sa, eb, sb, depth):
        xa, xb = ea.invars[0], eb.invars[0]
        axes = set(ea.params.get("axes", ()))
        grown = [d for d, (m, n) in enumerate(zip(xa.aval.shape, xb.aval.shape)) if m != n]
        if grown:  # the rows' axis: the leading one, or another (an ensemble's (E, B) losses)
            if len(grown) > 1 or grown[0] not in axes or (
                    xb.aval.shape[grown[0]] != self.scale * xa.aval.shape[grown[0]]):
                return self.fail(f"{_a(name)} {name} over an axis other than the batch rows, or over "
                                  "several axes that grow with the batch")
            return ("k", _REDUCTIONS[name])
        inner = stacked_kind(self, xa, sa, xb, sb, depth)
        if inner is NOT_STACKED:
            inner = self.kind(xa, sa, xb, sb, depth + 1)
        if inner is None:
            return None
        if inner[0] == "c":
            return ("c", None)
        if inner[0] == "k" and (inner[1] == _REDUCTIONS[name]
                                or name == "reduce_sum" and inner[1] == MEAN):
            return inner
        return self.fail(f"{_a(name)} {name} of a {inner[0] == 'k' and inner[1] or 'count'}")

    def _op(self, name, eqn, args):
        if name in _SAME:
            return args[0]
        if name == "convert_element_type":
            r = args[0]
            if r[0] == "k" and r[1] in (MEAN, SUM) and not np.issubdtype(
                    eqn.params["new_dtype"], np.inexact):
                return self.fail("a mean or sum rounded to an integer")
            return r
        if name == "neg":
            r = args[0]
            return ("k", _FLIP[r[1]]) if r[0] == "k" else ("c", None if r[0] != "c" or r[1] is None
                                                             else -r[1])
        if name in ("add", "sub"):
            x, y = args
            if name == "sub" and y[0] == "k":
                y = ("k", _FLIP[y[1]])
            if x[0] == "c" and y[0] == "c":
                return ("c", None)
            ks = [r for r in (x, y) if r[0] == "k"]
            if len(ks) == 2:
                if x[1] == y[1] and x[1] in (MEAN, SUM):
                    return x
                return self.fail(f"a {x[1]} {name} a {y[1]}")
            other = y if x[0] == "k" else x
            if name == "sub" and x[0] == "c":  # c - k: the flipped kind, above
                ks = [y]
            if len(ks) == 1 and other[0] == "c" and (
                    ks[0][1] != SUM or other[1] == 0 or self.summed_loss):
                return ks[0]
            return self.fail(
                _GUARDED.format(how="plus a constant (mask.sum() + eps)")
                if ks and ks[0][1] == SUM else "a value that grows with the batch, added")
        if name in ("mul", "div"):
            return self._scaled(name, *args)
        if name in ("max", "min"):
            want = MAX if name == "max" else MIN
            if all(r[0] == "c" for r in args):
                return ("c", None)
            if all(r[0] == "c" or r == ("k", want) for r in args):
                return ("k", want)
            if name == "max" and sorted(r[0] for r in args) == ["c", "k"] and ("k", SUM) in args:
                return self.fail(_GUARDED.format(how="kept from zero (jnp.maximum(mask.sum(), 1))"))
        return self.fail(f"{_a(name)} {name}" if name not in ("max", "min") else
                          f"an elementwise {name}")

    def _scaled(self, name, x, y):
        """``x * y`` or ``x / y``, from the kinds of ``x`` and ``y``."""
        if x[0] == "c" and y[0] == "c":
            return ("c", None)
        if name == "mul" and y[0] == "k":
            x, y = y, x
        if x[0] != "k" or y[0] == "k":
            return self.fail(_RATIO if name == "div" and x == y == ("k", SUM) else
                              f"{_a(name)} {name} of two values from the batch" if y[0] == "k"
                              else "a division by a value from the batch")
        grows = ("up",) if name == "div" else ("down",)
        if y == grows:  # divided by the rows' count: a sum becomes a mean
            return ("k", MEAN) if x[1] == SUM else self.fail(
                f"a {x[1]} divided by a count of rows")
        if y[0] != "c":
            return self.fail("a value scaled by a count of rows")
        if x[1] in (MEAN, SUM):
            return x
        if y[1] is None or y[1] == 0:
            return self.fail(f"a {x[1]} scaled by a value of unknown sign")
        return x if y[1] > 0 else ("k", _FLIP[x[1]])
