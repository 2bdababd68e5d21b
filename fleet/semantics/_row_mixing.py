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
jaxpr (the rules, one per primitive: :mod:`fleet.semantics._row_rules`): a value
computed from a batch argument has a *row axis* (the batch's leading axis, moved
by transposes, broadcasts and ``vmap``'s batching) with its rows in an order, or
is *partial*, reduced over the replica's rows (a sum, a mean, a max: fleet
combines those where they leave the step, and reduces gradients). Reordering
the rows alone (a reversal, a sort, an index, a concatenation of two batches, as
a GAN's discriminator takes real and generated rows) changes nothing a mean
sees; it refuses, naming the user's line: rows in one order combined with rows
in another (``x + x[perm]``), some rows taken (a slice, ``jnp.roll``,
``jax.lax.top_k``), a padded or cumulative row axis, a product of every row with
every row (a matrix of row pairs), and a partial value combined with the rows it
came from where what is made of it reaches a gradient's reduction over the
replicas (the loss mixed its rows: a batch mean subtracted, class weights counted
with ``jnp.bincount``; a standard deviation that is only returned is the outputs'
check's,
:mod:`fleet.semantics._outputs`; ``strategy.sync_batch_norm = False`` mixes
them on purpose, and is not refused), and a decision made from a partial value
(the replica's loss compared with a limit) applied to values the same on every
replica where that reaches a gradient's reduction (a step skipped on a loss
spike, ``jnp.where(loss < limit, grads, 0)``), or a branch on it
(``nnx.cond(loss < limit, apply, skip, ...)``). A value fleet reduces over the replicas
(its buckets, ``fleet.all_reduce``, ``fleet.all_gather``, a ``psum``) is
global: it has no row axis.

It follows ``scan`` bodies (``nnx.scan`` over layers, a scan over micro-batches
made by a reshape the walk does not follow; a block picked is refused:
``fleet.semantics._row_blocks``), each branch of a ``cond`` and a
``while_loop``'s body (``fleet.semantics._row_control``). What it cannot follow
(a loop over the rows themselves, another reshape that splits the rows, an
operation of the rows it does not know) it leaves unchecked from there on; an
operation of values reduced over the rows alone makes such a
value.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal

from fleet import _compat
from fleet._errors import FleetError
from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import CALLS, ELEMENTWISE, holds_reduction
from fleet.semantics._row_blocks import BlockScans, is_blocks, row_blocks
from fleet.semantics._row_control import ControlFlow
from fleet.semantics._row_rules import RULES, blocks_rule
from fleet.semantics._row_tags import (
    PARTIAL,
    UNKNOWN,
    Index,
    Row,
    is_index,
    is_row,
    met,
)

_DECISIONS = frozenset(("eq", "ne", "lt", "le", "gt", "ge", "is_finite"))
_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin"))
_GLOBAL = frozenset(("psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_to_all"))

_MIXED = (
    "the step combines different rows of its batch: {what} ({where}). Inside a fleet step "
    "each replica computes on its own {rows} rows, so this would see that replica's rows "
    "where the single-device step sees the whole global batch, and train differently. Keep "
    "the step row-wise: each row's value computed from that row alone, then means or sums "
    "over the rows (a loss averaged over the rows is fine; one divided by the batch's "
    "total mask is not: divide it by fleet.all_reduce(mask.sum(), 'avg'), and take other "
    "statistics of the batch's data, such as advantages' mean, as fleet.all_reduce(x.mean(), "
    "'avg')). Mix or shuffle rows (mixup, a flipped batch) in the data pipeline, "
    "before the step; for a loss over pairs of rows (a contrastive loss), compare the "
    "replica's rows with every replica's, gathered: za @ fleet.all_gather(zb).reshape(-1, "
    "d).T, the positives offset by jax.lax.axis_index(fleet.DATA_AXIS) * rows")


def tables_hint(rows: frozenset) -> str:
    """For a refusal of a step whose batch arguments split into different row
    counts: that one may be a table, not batch data (empty for one row count)."""
    if len(rows) < 2:
        return ""
    return (f". The batch arguments split into {' or '.join(map(str, sorted(rows)))} rows "
            "each: if one is not batch data (a table of class weights, a prior), pass "
            "distributed_step(fn, batch_argnums=...) naming only the batch's positions, and "
            "it reaches every replica whole")


class _Rows(ControlFlow):
    """The walk: each variable's tag (``fleet.semantics._row_rules``)."""

    def __init__(self, rows: frozenset, partial_mixing: bool, blocks: frozenset = frozenset()):
        self.rows = rows
        self.partial_mixing = partial_mixing  # refuse a partial value met by its rows
        #: (replica shape, new shape) of the reshapes that split the rows into blocks of
        #: the global batch's consecutive rows (:func:`row_blocks`; the rules read it)
        self.blocks = blocks
        self.tags: dict = {}
        self.calls: list = []  # the call equations the walk is inside (their lines)
        #: id(var) -> the equation that combined a partial value with its rows, for
        #: the values computed from it: refused where one reaches a gradient
        self.mixed: dict = {}
        #: id(var) -> the comparison of a partial value (the replica's loss) whose
        #: decision it carries onto values the same on every replica (the averaged
        #: gradients): refused where one reaches a gradient's reduction
        self.decided: dict = {}
        self.block_scans = BlockScans()  # scans over blocks of the rows, and what they carry
        self.reorders: dict = {}  # a row order -> what made it
        self.producer: dict = {}  # id(var) -> the equation that made it (the rules read it)
        self.sources: dict = {}  # id(var) -> the step's argument it is, as given (its name)

    def tag(self, v: Any) -> Any:
        return None if isinstance(v, Literal) else self.tags.get(id(v))

    def refuse(self, eqn: Any, what: str, calls: list | None = None) -> None:
        calls = self.calls if calls is None else calls
        where = next(filter(None, map(_compat.user_line, [eqn, *reversed(calls)])),
                     f"a {eqn.primitive.name} in the step")
        raise FleetError(_MIXED.format(what=what, where=where, rows=" or ".join(
            map(str, sorted(self.rows)))) + tables_hint(self.rows))

    def reorder(self, eqn: Any, row: Row, what: str) -> Row:
        """``row``, a new order of the rows that ``eqn`` made (``what``, for the error
        where it meets the rows in another order)."""
        self.reorders.setdefault(row.order, what)
        return row

    def walk(self, jaxpr: Any, tags: list) -> list:
        """Tags ``jaxpr``'s inputs, walks its equations; its outputs' tags."""
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        for v, t in zip(jaxpr.invars, tags):
            if t is not None:
                self.tags[id(v)] = t
        self.producer.update((id(v), e) for e in jaxpr.eqns for v in e.outvars)
        for eqn in jaxpr.eqns:
            self.follow(self.mixed, eqn)
            self.block_scans.follow(eqn)
            ins = [self.tag(v) for v in eqn.invars]
            if any(t is not None for t in ins):
                outs = self.eqn(eqn, ins)
                for v, t in zip(eqn.outvars, outs):
                    if t is not None:
                        self.tags[id(v)] = t
            elif eqn.primitive.name == "iota":  # (an index as long as the rows: Index)
                dim = eqn.params.get("dimension", 0)
                if eqn.outvars[0].aval.shape[dim] in self.rows:
                    self.tags[id(eqn.outvars[0])] = Index(dim)
            self.follow(self.decided, eqn, ins)  # (after the outputs' tags: see follow)
        return [self.tag(v) for v in jaxpr.outvars]

    def follow(self, marks: dict, eqn: Any, ins: list | None = None) -> None:
        """A value marked in ``marks`` is refused where it reaches a gradient's
        reduction over the replicas, and passed on to what is computed from it
        otherwise.

        ``mixed``: a partial value combined with its rows (so the loss mixed its
        rows). ``decided`` (``ins``: the equation's tags): a replica's own decision
        (``loss < limit``) applied to values the same on every replica
        (``jnp.where(ok, grads, 0)``: the distributed optimizer averages gradients
        that differ, where one device decides once on the global batch); met by
        the rows or by other partial values (a cotangent gated alike, an empty
        batch's guard) it is the rows' own business, and is dropped; combined over
        the replicas by the step itself (``fleet.all_reduce(ok, 'min')``: an output
        with no tag, global) it is the step's choice, and ends there."""
        origin = next((marks[id(v)] for v in eqn.invars
                       if not isinstance(v, Literal) and id(v) in marks), None)
        if origin is None:
            return
        if holds_reduction(eqn) or (marks is self.decided and eqn.primitive.name == "cond"
                             and id(eqn.invars[0]) in marks):  # (a branch on it)
            self.refuse(*origin)
        if ins is not None and any(t is not None for v, t in zip(eqn.invars, ins)
                                   if isinstance(v, Literal) or id(v) not in marks):
            return
        for v in eqn.outvars:
            if ins is None or self.tag(v) is not None:
                marks.setdefault(id(v), origin)

    def eqn(self, eqn: Any, ins: list) -> list:
        """The outputs' tags of one equation with some tagged inputs."""
        name, n_out = eqn.primitive.name, len(eqn.outvars)
        if any(map(is_index, ins)):
            ins = met(ins)
            if all(t is None or is_index(t) for t in ins) and name not in CALLS and (
                    name != "scan"):
                return _index_only(self, eqn, ins)
        call = eqn.params.get("name")
        if call in FLEET_CALLS or name in _GLOBAL:
            return [None] * n_out  # (reduced over the replicas: global, whatever came in)
        if UNKNOWN in ins:
            return [UNKNOWN] * n_out
        if any(map(is_blocks, ins)) and name not in CALLS and name != "scan":
            return blocks_rule(self, eqn, ins)
        if call == "fleet_mark":
            return ins
        if name in CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if inner is not None and len(getattr(inner, "jaxpr", inner).invars) == len(ins):
                self.calls.append(eqn)
                self.sources.update((id(v), self.sources[id(o)])
                                    for o, v in zip(eqn.invars, getattr(inner, "jaxpr", inner).invars)
                                    if id(o) in self.sources)
                try:
                    outs = self.walk(inner, ins)
                finally:
                    self.calls.pop()
                self.mixed_out(inner, eqn)
                return outs
            return [UNKNOWN] * n_out
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "cond":
            return self.branches(eqn, ins)
        if name == "while":
            return self.loop(eqn, ins)
        rule = RULES.get(name)
        if rule is not None:
            return rule(self, eqn, ins)
        if name in ELEMENTWISE:
            return [self.elementwise(eqn, ins)] * n_out
        if name in _REDUCTIONS:
            return [self.reduction(eqn, ins[0])] * n_out
        # (an operation it does not know, of values reduced over the rows alone: such a value)
        return [UNKNOWN if any(map(is_row, ins)) else PARTIAL] * n_out

    def elementwise(self, eqn: Any, ins: list) -> Any:
        rows = [t for t in ins if is_row(t)]
        if len({t.axis for t in rows}) > 1:
            self.refuse(eqn, "every row paired with every row (z[:, None] - z[None, :]: a "
                             "matrix of row pairs, as a triplet loss's distances)")
        if len({t.order for t in rows}) > 1:
            order = next(t.order for t in rows if t.order != 0)
            self.refuse(eqn, f"{self.reorders.get(order, 'the rows reordered')}, then "
                             "combined with the rows in another order")
        if rows and PARTIAL in ins:
            return self.combine(eqn)
        if not rows and eqn.primitive.name in _DECISIONS:
            origin = (eqn, "a decision made from a value reduced over the replica's rows (its "
                           "own loss compared with a limit, say) applied to values every "
                           "replica holds alike (the averaged gradients): decide on the "
                           "global value, fleet.all_reduce(loss, 'avg') < limit",
                      list(self.calls))
            for v in eqn.outvars:
                self.decided[id(v)] = origin
        return rows[0] if rows else PARTIAL

    def combine(self, eqn: Any) -> Any:
        """``eqn`` combines a partial value with the rows it came from: what is made of
        it is refused where it reaches a gradient (:meth:`follow`)."""
        if self.partial_mixing:
            origin = (eqn, "a value reduced over the replica's rows (a sum, mean, maximum "
                           "or count over the batch) combined with the rows themselves",
                      list(self.calls))
            for v in eqn.outvars:
                self.mixed[id(v)] = origin
        return UNKNOWN

    def reduction(self, eqn: Any, t: Any) -> Any:
        if not is_row(t):
            return t
        axes = tuple(eqn.params.get("axes", ()))
        if t.axis in axes:
            return PARTIAL
        return Row(t.axis - sum(a < t.axis for a in axes), t.order)


_INDEX_MOVES = frozenset(("broadcast_in_dim", "transpose", "squeeze", "reshape", "gather"))


def _index_only(walk: Any, eqn: Any, ins: list) -> list:
    """The tags of an equation whose tagged inputs are all indices: moved with
    their axis (a broadcast, an embedding's lookup of positions), kept through
    elementwise ops along one axis, and a constant after anything else."""
    n_out, name = len(eqn.outvars), eqn.primitive.name
    if name in _INDEX_MOVES and (name != "gather" or ins[0] is None):
        outs = RULES[name](walk, eqn, [Row(t.axis) if is_index(t) else t for t in ins])
        return [Index(t.axis) if is_row(t) else None for t in outs]
    axes = {t.axis for t in ins if is_index(t)}
    if name in ELEMENTWISE and len(axes) == 1:
        return [Index(axes.pop())] * n_out
    return [None] * n_out


def check_rows(body: Any, batch_at: range, rows: frozenset, partial_mixing: bool,
               reference: Any = None, replicas: int = 1, names: tuple = ()) -> None:
    """Refuses a per-replica ``body`` (the probe's shard_map jaxpr) that combines
    different rows of the batch (see the module docstring); ``batch_at``: the
    body's inputs that are batch leaves, each of ``rows`` rows (``names``: the
    step's argument each one is, for a refusal to name). ``reference``: the
    single-device step's jaxpr on the global batch, over ``replicas``."""
    inner = getattr(body, "jaxpr", body)
    tags = [Row(0) if i in batch_at and v.aval.ndim and v.aval.shape[0] in rows else None
            for i, v in enumerate(inner.invars)]
    if rows and any(t is not None for t in tags):
        blocks = row_blocks(reference, replicas) if reference is not None else frozenset()
        walk = _Rows(rows, partial_mixing, blocks)
        walk.sources.update((id(inner.invars[i]), name) for i, name in zip(batch_at, names))
        walk.walk(inner, tags)
