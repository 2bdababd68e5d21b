"""The replica's row count used as more than a scale before the gradient: refused by name.

A mean over the batch divides by the rows it saw, and inside a fleet step those
are the replica's: ``jnp.mean`` divides by 4 where the single-device step on the
global batch divides by 16. fleet is exact where that count only scales what
reaches the gradient: each replica's gradient is then ``A + B_r / rows``, and
the replicas' mean of it is the single-device ``A + B / global rows``. A value
scaled by the count, then put through anything but a scale, is not: a PGD step
``x + 0.1 * jax.grad(loss)(x)`` fed to the model, features ``x / x.shape[0]``, a
penalty of the mean's input gradient (docs/contract.md; tests/test_input_gradients.py).

:func:`check_row_count` finds the count as the literals of the replica's trace
(a float; jax 0.12 writes ``x.shape[0]`` as an integer, then converts it) whose
value in the single-device trace (the same equation, paired by
``fleet.semantics._jaxpr_scope.paired_eqns``) is N times theirs (a count, the
divisor of a mean) or 1 / N times (one over it); a literal that is exactly 1 on
one device is the replica count (a ``pmean``'s divisor), not the rows'. It
follows each value forward as the powers of ``s = 1 / rows`` it is a sum of:
``{0}`` free of it, ``{0, 1}`` ``A + s B`` (a mean loss plus a penalty, and its
backward pass), the empty set a zero, ``None`` not such a sum (the count through
a ``tanh``). An integer operand beside a float one is an index, not part of the
value; integers compared with integers (positions, one-hot labels offset by
``axis_index * rows``) decide alike at any scale. fleet's reductions over the
replicas (its buckets, ``fleet.all_reduce``, a ``psum``) give global values,
free of it.

Refused, naming the line the count came from and the line that used it as more
than a scale: a gradient bucket that gets anything but ``A + s B``; a ``psum``
that gets neither that nor one power of ``s`` (JAX's sum of a functional step's
raw gradients); a varying scalar output fleet combines that is not ``A + s B`` (a
mean of ``jnp.tanh(x / x.shape[0])``). Per-example outputs are
``fleet.semantics._row_scale``'s; a step with ``strategy.sync_batch_norm = False``
(per-replica statistics, chosen on purpose) is not checked.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params

from fleet import _compat
from fleet._errors import FleetError
from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import CALLS, GRADIENT_BUCKETS, PSUMS, paired_eqns

ZERO, NONE = frozenset((0,)), frozenset()  # free of the count; a zero (no terms)
_MAX = 4  # higher powers are not followed: None
#: fleet's values the same on every replica (global: free of the count)
_GLOBAL_CALLS = frozenset(FLEET_CALLS) - {"fleet_batch_norm", "fleet_all_gather"}  # (walked into)
_GLOBAL = frozenset(("psum", "psum_invariant", "pmax", "pmin", "reduce_scatter"))
_PRODUCTS = frozenset(("mul", "dot_general", "conv_general_dilated"))
#: f(s^d x) = s^d f(x) for s > 0, one power d
_HOMOGENEOUS = frozenset(("abs", "max", "min", "reduce_max", "reduce_min", "sort", "cummax",
                          "cummin", "reduce_window_max", "reduce_window_min", "top_k"))
#: f(s^d x) = f(x): the same decision at any scale
_SCALE_FREE = frozenset(("sign", "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "argmax",
                         "argmin"))
#: not a scale of their operands (any other equation is taken as a sum of its
#: operands' terms: a layout change, a reduction, a slice, a transform that is linear)
_NONLINEAR = frozenset((
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan2", "pow", "erf", "erfc",
    "erf_inv", "lgamma", "digamma", "igamma", "igammac", "polygamma", "zeta", "bessel_i0e",
    "bessel_i1e", "regularized_incomplete_beta", "cbrt", "sqrt", "rsqrt", "integer_pow", "square",
    "floor", "ceil", "round", "rem", "nextafter", "clamp", "cumprod", "cumlogsumexp",
    "reduce_prod", "cholesky", "eigh", "eig", "svd", "qr", "lu", "triangular_solve", "div",
    "random_gamma_grad", *_HOMOGENEOUS, *_SCALE_FREE))

_WHAT = {"mul": "a product of two values scaled so", "integer_pow": "a power", "square": "a square",
         "div": "a division by a value scaled so (a norm plus an epsilon?)"}
_GRADIENT = ("the gradient fleet averages over the {n} replicas", "Each replica's gradient is "
             "then not its share of the single-device gradient, and their mean is not the "
             "single-device one")
_SUMMED = ("a value summed over the {n} replicas (a psum: JAX's, of the gradient of raw "
           "parameters, or the step's own)", "Each replica's part is then not its share of "
           "the single-device value, and their sum is not the single-device one")
_OUTPUT = ("{name}, which fleet combines over the {n} replicas,", "No combination of the "
           "replicas' values then gives the single-device value")
_USED = (
    "{subject} depends on the replica's row count other than as a scale: {origin}, and "
    "{use}. {effect}. "
    "This is a step along the raw gradient of a mean loss with respect to the batch (an "
    "adversarial example, PGD; an epsilon guarding its norm counts too: it clamps the rows "
    "whose gradient is small), a penalty of that gradient, or features divided by the batch "
    "size. Use a form free of the scale (jnp.sign(g), as FGSM does, or each row's gradient "
    "over its own norm), or rescale to the global batch where the single-device value is "
    "meant: g * x.shape[0] / fleet.all_reduce(x.shape[0]) for the input gradient of a mean "
    "loss, x / fleet.all_reduce(x.shape[0]) for a feature divided by the batch size")
_ORIGIN = ("{line} divides by the rows the replica sees (a mean over the batch, x.shape[0]: "
           "{here:g} where the single-device step on the global batch has {there:g})")


def check_row_count(body: Any, reference: Any, replicas: int, outputs: list[str]) -> None:
    """Refuses the step when a gradient bucket or ``psum`` of ``body`` (the probe's
    per-replica jaxpr), or one of its first outputs (the varying scalars fleet
    combines, named ``outputs``), is not ``A + B / rows`` in the replica's row
    count, found against ``reference`` (the single-device body on the global batch)."""
    if reference is None or replicas == 1:
        return
    counts = _Counts(replicas)
    body = getattr(body, "jaxpr", body)
    powers = counts.walk(body, reference, [ZERO] * len(body.invars))
    for name, v, p in zip(outputs, body.outvars, powers):
        if not _affine(p):
            counts.refuse(v, p, _OUTPUT, name)


def _is_float(v: Any) -> bool:  # (complex too)
    return jax.dtypes.issubdtype(v.aval.dtype, np.inexact)


def _is_int(v: Any) -> bool:  # (not bool: a decision)
    return jax.dtypes.issubdtype(v.aval.dtype, np.integer)


def _union(powers: list) -> frozenset | None:
    return None if any(p is None for p in powers) else frozenset().union(*powers)


def _times(a: frozenset, b: frozenset) -> frozenset | None:
    out = frozenset(x + y for x in a for y in b)
    return out if all(abs(d) <= _MAX for d in out) else None


def _affine(p: frozenset | None) -> bool:
    return p is not None and p <= {0, 1}


def _mixed(p: frozenset | None) -> bool:
    """Neither ``A + s B`` nor one power of ``s`` times a value: nothing after undoes it."""
    return p is None or (len(p) > 1 and not p <= {0, 1})


class _Counts:
    """The forward walk: each variable's powers of ``1 / rows``; for a value that
    has some, the count it came from (``origin``: the equation, its literal here
    and on one device), and for one that is not ``A + s B``, the equation that
    made it so (``use``)."""

    def __init__(self, replicas: int):
        self.n = replicas
        self.powers: dict[int, frozenset | None] = {}
        self.origin: dict[int, tuple] = {}
        self.use: dict[int, Any] = {}
        self.calls: list = []  # the call equations the walk is inside (their lines)
        self.twins: dict = {}  # (id(jaxpr), id(its twin)) -> id(eqn) -> the twin's equation

    def of(self, v: Any) -> frozenset | None:
        if not isinstance(v, Literal):
            return self.powers.get(id(v), ZERO)
        val = v.val
        return NONE if (val == 0 if isinstance(val, (int, float, np.number)) else
                        not np.any(val)) else ZERO

    def seed(self, eqn: Any, v: Any, w: Any) -> frozenset | None:
        """The powers of literal ``v``: one whose single-device twin ``w`` is N or
        1 / N times it is the row count (power -1) or one over it (1)."""
        if not (isinstance(w, Literal)
                and (_is_int(v) or jax.dtypes.issubdtype(v.aval.dtype, np.floating))
                and np.shape(v.val) == () and np.shape(w.val) == ()):
            return self.of(v)
        here, there = float(v.val), float(w.val)
        if here == 0 or there == 0 or here == there or there == 1.0:
            return self.of(v)  # (exactly 1 on one device: the replica count)
        for ratio, power in ((self.n, -1), (1 / self.n, 1)):
            if np.isclose(there / here, ratio, rtol=1e-6):
                self.origin.setdefault(id(eqn), (self.line(eqn), here, there))
                return frozenset((power,))
        return self.of(v)

    def walk(self, jaxpr: Any, ref: Any, ins: list, outer: list = ()) -> list:
        """``jaxpr``'s outputs' powers, its inputs' given (``outer``: the variables
        they come from, whose origin and use they take); ``ref``: the single-device
        trace's same jaxpr (its literals are the count's twins), or None."""
        jaxpr, ref = getattr(jaxpr, "jaxpr", jaxpr), getattr(ref, "jaxpr", ref)
        for v, p in zip(jaxpr.invars, ins):
            self.powers[id(v)] = p
        for v, u in zip(jaxpr.invars, outer):
            for marks in (self.origin, self.use):
                if not isinstance(u, Literal) and id(u) in marks:
                    marks[id(v)] = marks[id(u)]
        key = (id(jaxpr), id(ref))  # (a loop's body is walked again; a shared jaxpr per call)
        if key not in self.twins:
            self.twins[key] = {} if ref is None else {
                id(a): b for a, b in paired_eqns(jaxpr.eqns, ref.eqns)
                if a.primitive == b.primitive and len(a.invars) == len(b.invars)}
        twins = self.twins[key]
        powers = self.powers
        for eqn in jaxpr.eqns:
            twin = twins.get(id(eqn))
            ps = [self.seed(eqn, v, None if twin is None else twin.invars[i])
                  if isinstance(v, Literal) else powers.get(id(v), ZERO)
                  for i, v in enumerate(eqn.invars)]
            outs = self.rule(eqn, twin, ps)
            for v, p in zip(eqn.outvars, outs):
                powers[id(v)] = p
                if p != ZERO and p != NONE:
                    self.trace(eqn, v, p, ps)
        return [self.of(v) for v in jaxpr.outvars]

    def trace(self, eqn: Any, v: Any, p: frozenset | None, ps: list) -> None:
        """Where ``v``'s count came from, and (not a scale, nor a mean plus a value free
        of the count) the line that made it so."""
        ids = [id(eqn)] + [id(u) for u in eqn.invars if not isinstance(u, Literal)]
        found = next((self.origin[i] for i in ids if i in self.origin), None)
        if found is not None:
            self.origin.setdefault(id(v), found)
        if _mixed(p) and id(v) not in self.use:
            made = not any(map(_mixed, ps))
            self.use[id(v)] = (eqn.primitive.name, self.line(eqn)) if made else next(
                (self.use[i] for i in ids[1:] if i in self.use), (eqn.primitive.name, None))

    def line(self, eqn: Any) -> str | None:
        """The user's line of ``eqn``, or of the innermost call it is in that has one."""
        return next(filter(None, map(_compat.user_line, [eqn, *reversed(self.calls)])), None)

    def rule(self, eqn: Any, twin: Any, ps: list) -> list:
        """An equation's outputs' powers, its operands' given."""
        name, call = eqn.primitive.name, str(eqn.params.get("name", ""))
        n_out = len(eqn.outvars)
        if name in CALLS and call in _GLOBAL_CALLS:
            if call in GRADIENT_BUCKETS:
                for v, p in zip(eqn.invars, ps):
                    if not _affine(p):
                        self.refuse(v, p, _GRADIENT)
            return [ZERO] * n_out
        if name in CALLS or name in ("scan", "while", "cond"):
            return self.nested(eqn, twin, ps)
        if name in _GLOBAL:
            if name in PSUMS:  # (JAX's sum of raw parameters' gradients, or the step's own)
                for v, p in zip(eqn.invars, ps):
                    if _mixed(p):
                        self.refuse(v, p, _SUMMED)
            return [ZERO] * n_out
        if name in ("optimization_barrier", "sort") and n_out == len(ps):
            return ps if name != "sort" or ps[0] is not None else [None] * n_out
        if all(p == ZERO for p in ps):
            return [ZERO] * n_out
        return [self.scaled(eqn, name, ps)] * n_out

    def scaled(self, eqn: Any, name: str, ps: list) -> frozenset | None:
        """The output powers of an equation some operand of which is not ``{0}``."""
        if any(p is None for v, p in zip(eqn.invars, ps) if not _is_int(v)):
            return None  # (a float, or a decision on one; an index is not the value's)
        floats = [p for v, p in zip(eqn.invars, ps) if _is_float(v)]
        if not floats and name in _SCALE_FREE:
            return ZERO  # (indices compared: positions, one-hot labels)
        ps = floats or ps  # (an index, a predicate: no terms of the value)
        if any(p is None for p in ps):
            return None
        if name in _PRODUCTS:
            return _times(ps[0], ps[1])
        if name == "div" and len(ps[1]) == 1:
            return _times(ps[0], frozenset(-d for d in ps[1]))
        if name not in _NONLINEAR:
            return _union(ps)
        terms = _union([p for p in ps if p != NONE])  # (a zero is any power of s times 0)
        if terms <= ZERO:
            return ZERO  # (a function of values free of the count)
        if len(terms) == 1:
            d = next(iter(terms))
            if name in ("integer_pow", "square"):
                return _times(frozenset((d * eqn.params.get("y", 2),)), ZERO)
            if name in ("sqrt", "rsqrt") and d % 2 == 0:
                return frozenset((d // 2 if name == "sqrt" else -d // 2,))
            if name in _HOMOGENEOUS:
                return terms
            if name in _SCALE_FREE:
                return ZERO
        return None

    def nested(self, eqn: Any, twin: Any, ps: list) -> list:
        """A call's, a loop's or a branch's outputs: its jaxpr walked beside its
        single-device twin's, a loop's carries again until their powers hold; each
        output's origin and use are its jaxpr's output's."""
        self.calls.append(eqn)
        try:
            outs = self.inside(eqn, twin, ps)
        finally:
            self.calls.pop()
        subs = [eqn.params["body_jaxpr"]] if eqn.primitive.name == "while" else (
            jaxprs_in_params(eqn.params))  # (not a while's condition: its one output is a flag)
        for sub in subs:
            for w, v in zip(getattr(sub, "jaxpr", sub).outvars, eqn.outvars):
                for marks in (self.origin, self.use):
                    if not isinstance(w, Literal) and id(w) in marks:
                        marks.setdefault(id(v), marks[id(w)])
        return outs

    def inside(self, eqn: Any, twin: Any, ps: list) -> list:
        name, p = eqn.primitive.name, eqn.params
        twin = twin if twin is not None and twin.primitive == eqn.primitive else None
        tp = {} if twin is None else twin.params
        if name == "scan":
            consts, carries = _compat.scan_counts(p)
            return self.settled(carries, ps[consts:consts + carries], lambda c: self.walk(
                p["jaxpr"], tp.get("jaxpr"), [*ps[:consts], *c, *ps[consts + carries:]],
                eqn.invars))
        if name == "while":
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            decided: list = []

            def once(carry: list) -> list:
                decided.append(self.walk(p["cond_jaxpr"], tp.get("cond_jaxpr"), [*ps[:nc], *carry],
                                         [*eqn.invars[:nc], *eqn.invars[nc + nb:]])[0])
                return self.walk(p["body_jaxpr"], tp.get("body_jaxpr"), [*ps[nc:nc + nb], *carry],
                                 eqn.invars[nc:])

            outs = self.settled(len(ps) - nc - nb, ps[nc + nb:], once)
            return [None] * len(outs) if decided[-1] is None else outs
        if name == "cond":
            theirs = tp.get("branches", ())
            outs = [self.walk(b, theirs[i] if len(theirs) == len(p["branches"]) else None,
                              ps[1:], eqn.invars[1:]) for i, b in enumerate(p["branches"])]
            return [None if ps[0] is None else _union(list(t)) for t in zip(*outs)]
        inner, other = p.get("jaxpr", p.get("call_jaxpr")), tp.get("jaxpr", tp.get("call_jaxpr"))
        body = getattr(inner, "jaxpr", inner)
        if not (hasattr(body, "eqns") and len(body.invars) == len(eqn.invars)
                and len(body.outvars) == len(eqn.outvars)):
            return [_union(ps)] * len(eqn.outvars)  # (not followed: as a linear map)
        return self.walk(inner, other, ps, eqn.invars)

    def settled(self, carries: int, carry: list, once: Any) -> list:
        """A loop's outputs: ``once(carry)`` (its body's outputs, the carries first)
        with each carry the union of its powers over the iterations."""
        for _ in range(4 * _MAX):
            outs = once(carry)
            joined = [_union([a, b]) for a, b in zip(carry, outs[:carries])]
            if joined == carry:
                return [*carry, *outs[carries:]]
            carry = joined
        return [None] * len(outs)

    def refuse(self, v: Any, p: frozenset | None, what: tuple, name: str = "") -> None:
        """Raises for ``v`` (powers ``p``; ``what``: :data:`_GRADIENT` or :data:`_OUTPUT`,
        ``name``'s), naming where the count came from and where it was used as more
        than a scale."""
        origin = self.origin.get(id(v))
        op, line = self.use.get(id(v), (None, None))
        op = "mul" if op == "dot_general" else op
        use = (f"{line or 'the step'} puts a value scaled so through "
               f"{_WHAT.get(op, f'a {op}, which is not a scale')}" if op is not None else
               f"it is that count to the power {-max(p, key=abs)}")
        raise FleetError(_USED.format(
            subject=what[0].format(n=self.n, name=name), effect=what[1], use=use, origin=(
                _ORIGIN.format(line=origin[0] or "the step", here=origin[1], there=origin[2])
                if origin is not None else "the step divides by the rows the replica sees")))
