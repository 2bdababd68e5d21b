"""Steps that combine different rows of the batch: refused by name.

A data-parallel step is right only where it is row-wise: each replica runs it on
its own rows, and fleet combines what comes out (the gradients, the outputs'
means and sums). An operation that mixes rows -- mixup's shuffle (``x[perm]``),
a flipped or rolled batch (``x[::-1]``, ``jnp.roll(x, 1, axis=0)``), a
contrastive loss's similarities between all rows (``z @ z.T``), a sort over the
rows, the batch's own mean subtracted from each row, a mean weighted by the
batch's total mask -- sees only the replica's rows inside a fleet step, where
the single-device step sees the global batch's. Before this check each trained
silently away from one device (4 CPU devices, 3 SGD steps, in the loss: a CLIP
loss 0.35, mixup 0.09, a sort 2.5, a flipped batch 0.03, a rolled one 0.006).

:func:`check_rows` follows the batch rows through the probe's per-replica
jaxpr: a value computed from a batch argument has a *row axis* (the batch's
leading axis, moved by transposes, broadcasts and ``vmap``'s batching), or is
*partial*, reduced over the replica's rows (a sum, a mean, a max: fleet combines
those where they leave the step, and reduces gradients). It refuses, naming the
primitive and the user's line: an operation along the row axis that is not a
reduction (a gather or slice of some rows, a reversal, a concatenation, a pad,
a sort, a cumulative sum), a product of two values whose row axes both stay
(a matrix of row pairs), and a partial value combined with the rows it came from
where what is made of it reaches a gradient's reduction over the replicas (the
loss mixed its rows; a standard deviation that is only returned is the outputs'
check's, :mod:`fleet.semantics._outputs`; ``strategy.sync_batch_norm = False``
mixes them on purpose, and is not refused).
A value fleet reduces over the replicas (its buckets, ``fleet.all_reduce``,
``fleet.all_gather``, a ``psum``) is global: it has no row axis.

What it cannot follow (a loop, ``nnx.scan`` over layers included, a reshape
that splits the rows, an operation it does not know) it leaves unchecked from
there on: the check refuses only what it sees.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal, jaxprs_in_params

from fleet import _compat
from fleet._errors import FleetError
from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import CALLS

PARTIAL, UNKNOWN = "partial", "unknown"  # (a row axis is an int)

_ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "sign", "floor",
    "ceil", "round", "is_finite", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "abs", "sqrt", "rsqrt", "cbrt", "square", "integer_pow",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "select_n", "clamp", "eq", "ne", "lt",
    "le", "gt", "ge", "and", "or", "not", "xor", "convert_element_type", "copy", "copy_p",
    "pvary", "pcast", "reduce_precision", "stop_gradient", "nextafter", "imag", "real",
    "conj", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
))
_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin"))
_CUMULATIVE = frozenset(("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"))
_GLOBAL = frozenset(("psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_to_all"))

_MIXED = (
    "the step combines different rows of its batch: {what} ({where}). Inside a fleet step "
    "each replica computes on its own {rows} rows, so this would see that replica's rows "
    "where the single-device step sees the whole global batch, and train differently. Keep "
    "the step row-wise: each row's value computed from that row alone, then means or sums "
    "over the rows (a loss averaged over the rows is fine; one divided by the batch's "
    "total mask is not). Mix or shuffle rows (mixup, a flipped batch) in the data pipeline, "
    "before the step; a loss over pairs of rows (a contrastive loss over the whole batch) "
    "cannot be made exact across replicas: train it on one device")


class _Rows:
    """The walk: each variable's row axis (an int), PARTIAL or UNKNOWN."""

    def __init__(self, rows: frozenset, partial_mixing: bool):
        self.rows = rows
        self.partial_mixing = partial_mixing  # refuse a partial value met by its rows
        self.tags: dict = {}
        self.calls: list = []  # the call equations the walk is inside (their lines)
        #: id(var) -> the equation that combined a partial value with its rows, for
        #: the values computed from it: refused where one reaches a gradient
        self.mixed: dict = {}

    def tag(self, v: Any) -> Any:
        return None if isinstance(v, Literal) else self.tags.get(id(v))

    def refuse(self, eqn: Any, what: str, calls: list | None = None) -> None:
        calls = self.calls if calls is None else calls
        where = next(filter(None, map(_compat.user_line, [eqn, *reversed(calls)])),
                     f"a {eqn.primitive.name} in the step")
        raise FleetError(_MIXED.format(what=what, where=where,
                                       rows=" or ".join(map(str, sorted(self.rows)))))

    def walk(self, jaxpr: Any, tags: list) -> list:
        """Tags ``jaxpr``'s inputs, walks its equations; its outputs' tags."""
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        for v, t in zip(jaxpr.invars, tags):
            if t is not None:
                self.tags[id(v)] = t
        for eqn in jaxpr.eqns:
            self.follow_mixed(eqn)
            ins = [self.tag(v) for v in eqn.invars]
            if any(t is not None for t in ins):
                outs = self.eqn(eqn, ins)
                for v, t in zip(eqn.outvars, outs):
                    if t is not None:
                        self.tags[id(v)] = t
            elif eqn.primitive.name == "iota":  # (an index over the rows is row-aligned)
                dim = eqn.params.get("dimension", 0)
                if eqn.outvars[0].aval.shape[dim] in self.rows:
                    self.tags[id(eqn.outvars[0])] = dim
        return [self.tag(v) for v in jaxpr.outvars]

    def follow_mixed(self, eqn: Any) -> None:
        """A value made from a partial one combined with its rows: refused where it
        reaches a gradient's reduction over the replicas (so the loss mixed its
        rows), passed on to what is computed from it otherwise."""
        origin = next((self.mixed[id(v)] for v in eqn.invars
                       if not isinstance(v, Literal) and id(v) in self.mixed), None)
        if origin is None:
            return
        if _reduces(eqn):
            self.refuse(*origin)
        for v in eqn.outvars:
            self.mixed.setdefault(id(v), origin)

    def eqn(self, eqn: Any, ins: list) -> list:
        """The outputs' tags of one equation with some tagged inputs."""
        name, n_out = eqn.primitive.name, len(eqn.outvars)
        if UNKNOWN in ins:
            return [UNKNOWN] * n_out
        call = eqn.params.get("name")
        if call in FLEET_CALLS or name in _GLOBAL:
            return [None] * n_out  # (reduced over the replicas: global)
        if call == "fleet_mark":
            return ins
        if name in CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if inner is not None and len(getattr(inner, "jaxpr", inner).invars) == len(ins):
                self.calls.append(eqn)
                try:
                    return self.walk(inner, ins)
                finally:
                    self.calls.pop()
            return [UNKNOWN] * n_out
        rule = _RULES.get(name)
        if rule is not None:
            return rule(self, eqn, ins)
        if name in _ELEMENTWISE:
            return [self.elementwise(eqn, ins)] * n_out
        if name in _REDUCTIONS:
            return [self.reduction(eqn, ins[0])] * n_out
        return [UNKNOWN] * n_out

    def elementwise(self, eqn: Any, ins: list) -> Any:
        axes = {t for t in ins if isinstance(t, int)}
        if len(axes) > 1:
            return UNKNOWN
        if axes and PARTIAL in ins:
            if self.partial_mixing:
                origin = (eqn, "a value reduced over the replica's rows (a sum, mean or "
                               "maximum over the batch) combined with the rows themselves",
                          list(self.calls))
                for v in eqn.outvars:
                    self.mixed[id(v)] = origin
            return UNKNOWN
        return axes.pop() if axes else PARTIAL

    def reduction(self, eqn: Any, t: Any) -> Any:
        if not isinstance(t, int):
            return t
        axes = tuple(eqn.params.get("axes", ()))
        if t in axes:
            return PARTIAL
        return t - sum(a < t for a in axes)


def _reduces(eqn: Any) -> bool:
    """Whether an equation reduces over the replicas (fleet's buckets, a psum), or
    holds one that does (a loop, a call)."""
    if eqn.params.get("name") in ("fleet_bucket", "fleet_scatter") or (
            eqn.primitive.name in ("psum", "psum_invariant")):
        return True
    return any(_reduces(e) for sub in jaxprs_in_params(eqn.params)
               for e in getattr(sub, "jaxpr", sub).eqns)


def _along(op: str):
    """A rule for an operation that mixes rows when it works along the row axis."""
    def rule(walk: _Rows, eqn: Any, ins: list) -> list:
        t = ins[0]
        if not isinstance(t, int):
            return [t] * len(eqn.outvars)
        p = eqn.params
        along = {"rev": lambda: t in p["dimensions"],
                 "sort": lambda: p["dimension"] == t,
                 "cumulative": lambda: p["axis"] == t,
                 "concatenate": lambda: p["dimension"] == t,
                 "pad": lambda: tuple(p["padding_config"][t]) != (0, 0, 0)}[op]()
        if along:
            walk.refuse(eqn, {"rev": "the rows reversed (x[::-1], jnp.flip)",
                              "sort": "a sort over the rows",
                              "cumulative": "a cumulative sum or product over the rows",
                              "concatenate": "rows concatenated or rolled (jnp.roll)",
                              "pad": "rows padded"}[op])
        if op == "concatenate" and any(x != t for x in ins):
            return [UNKNOWN]
        return [t] * len(eqn.outvars)
    return rule


def _slice(walk: _Rows, eqn: Any, ins: list) -> list:
    t = ins[0]
    if not isinstance(t, int):
        return [t]
    size, out = eqn.invars[0].aval.shape[t], eqn.outvars[0].aval.shape[t]
    if out != size:
        walk.refuse(eqn, f"some of the rows taken ({out} of {size}: x[:k], jnp.split)")
    return [t]


def _split(walk: _Rows, eqn: Any, ins: list) -> list:
    t = ins[0]
    if t == eqn.params["axis"]:
        walk.refuse(eqn, "the rows split (jnp.split over the batch)")
    return [t] * len(eqn.outvars)


def _top_k(walk: _Rows, eqn: Any, ins: list) -> list:
    t = ins[0]
    if t == eqn.invars[0].aval.ndim - 1:
        walk.refuse(eqn, "the top rows picked (jax.lax.top_k over the rows)")
    return [t] * len(eqn.outvars)


def _windowed(walk: _Rows, eqn: Any, ins: list) -> list:
    """Pooling (``reduce_window``) and its gradient: row-wise when its window
    does not span the rows."""
    t = next((x for x in ins if x is not None), None)
    if not isinstance(t, int) or any(x not in (None, t) for x in ins):
        return [UNKNOWN] * len(eqn.outvars)
    return [t if eqn.params["window_dimensions"][t] == 1 else UNKNOWN] * len(eqn.outvars)


def _conv(walk: _Rows, eqn: Any, ins: list) -> list:
    lt, rt = ins[:2]
    dn = eqn.params["dimension_numbers"]
    if isinstance(lt, int) and rt is None and lt == dn.lhs_spec[0]:
        return [dn.out_spec[0]]
    if isinstance(lt, int) and isinstance(rt, int) and (lt, rt) == (
            dn.lhs_spec[1], dn.rhs_spec[1]):
        return [PARTIAL]  # (a kernel's gradient: the rows contracted)
    return [UNKNOWN]


def _gather(walk: _Rows, eqn: Any, ins: list) -> list:
    t, idx = ins[0], ins[1]
    dn = eqn.params["dimension_numbers"]
    if isinstance(t, int):
        if t in dn.operand_batching_dims or idx is not None:
            return [UNKNOWN]  # (take_along_axis, x[arange(n), y]: row by row)
        if t in dn.start_index_map:
            walk.refuse(eqn, "rows picked by index (x[perm], jnp.take over the rows)")
        if eqn.params["slice_sizes"][t] != eqn.invars[0].aval.shape[t] or t in (
                dn.collapsed_slice_dims):
            return [UNKNOWN]
        kept = [d for d in range(eqn.invars[0].aval.ndim)
                if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
        return [dn.offset_dims[kept.index(t)]]
    if isinstance(idx, int) and idx < eqn.invars[1].aval.ndim - 1:
        batch = [d for d in range(eqn.outvars[0].aval.ndim) if d not in dn.offset_dims]
        return [batch[idx]] if idx < len(batch) else [UNKNOWN]
    return [UNKNOWN if t is not None or idx is not None else None]


def _dot(walk: _Rows, eqn: Any, ins: list) -> list:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lt, rt = ins
    if PARTIAL in ins:
        return [PARTIAL if None in ins else UNKNOWN]
    ln, rn = eqn.invars[0].aval.ndim, eqn.invars[1].aval.ndim
    lfree = [d for d in range(ln) if d not in lc and d not in lb]
    rfree = [d for d in range(rn) if d not in rc and d not in rb]
    if isinstance(lt, int) and isinstance(rt, int):
        if lt in lb and rt in rb and lb.index(lt) == rb.index(rt):
            return [lb.index(lt)]
        if lt in lc and rt in rc and lc.index(lt) == rc.index(rt):
            return [PARTIAL]  # (rows contracted: a gradient's sum over the rows)
        if lt in lfree and rt in rfree:
            walk.refuse(eqn, "a product of every row with every row (z @ z.T: a contrastive "
                             "loss's similarity matrix)")
        return [UNKNOWN]
    t, side, free, batch, contract = ((lt, 0, lfree, lb, lc) if isinstance(lt, int)
                                      else (rt, 1, rfree, rb, rc))
    if t in contract:
        return [PARTIAL]
    if t in batch:
        return [batch.index(t)]
    return [len(lb) + (0 if side == 0 else len(lfree)) + free.index(t)]


def _broadcast(walk: _Rows, eqn: Any, ins: list) -> list:
    t = ins[0]
    return [eqn.params["broadcast_dimensions"][t] if isinstance(t, int) else t]


def _transpose(walk: _Rows, eqn: Any, ins: list) -> list:
    t = ins[0]
    return [list(eqn.params["permutation"]).index(t) if isinstance(t, int) else t]


def _squeeze(walk: _Rows, eqn: Any, ins: list) -> list:
    t, dims = ins[0], eqn.params["dimensions"]
    if not isinstance(t, int):
        return [t]
    return [UNKNOWN if t in dims else t - sum(d < t for d in dims)]


def _reshape(walk: _Rows, eqn: Any, ins: list) -> list:
    t = ins[0]
    old, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if isinstance(t, int) and old[:t + 1] != tuple(new[:t + 1]):
        return [UNKNOWN]  # (the rows split or merged: not followed)
    return [t]


_RULES = {
    "rev": _along("rev"), "sort": _along("sort"), "concatenate": _along("concatenate"),
    "pad": _along("pad"), **{name: _along("cumulative") for name in _CUMULATIVE},
    "slice": _slice, "dynamic_slice": _slice, "split": _split, "top_k": _top_k,
    "gather": _gather, "dot_general": _dot, "conv_general_dilated": _conv,
    **{name: _windowed for name in ("reduce_window_sum", "reduce_window_max",
                                    "reduce_window_min", "reduce_window",
                                    "select_and_scatter_add", "select_and_gather_add")},
    "broadcast_in_dim": _broadcast, "transpose": _transpose, "squeeze": _squeeze,
    "reshape": _reshape,
}


def check_rows(body: Any, batch_at: range, rows: frozenset, partial_mixing: bool) -> None:
    """Refuses a per-replica ``body`` (the probe's shard_map jaxpr) that combines
    different rows of the batch (see the module docstring); ``batch_at``: the
    body's inputs that are batch leaves, each of ``rows`` rows."""
    inner = getattr(body, "jaxpr", body)
    tags = [0 if i in batch_at and v.aval.ndim and v.aval.shape[0] in rows else None
            for i, v in enumerate(inner.invars)]
    if rows and any(t is not None for t in tags):
        _Rows(rows, partial_mixing).walk(inner, tags)
