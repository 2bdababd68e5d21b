"""The rows' rules of :mod:`fleet.semantics._row_mixing`, one per primitive
(those of linear algebra and Fourier transforms: :mod:`fleet.semantics._row_linalg`).

A value's tag says how it holds the replica's batch rows: a :class:`Row` (its
row axis, and the order of the rows along it: ``0`` is the batch's own),
:data:`PARTIAL` (reduced over the rows: a sum, a mean, a maximum), or
:data:`UNKNOWN` (the walk does not follow it); untagged values do not depend
on the batch. An :class:`Index` is an index as long as the replica's rows
(``jnp.arange(n)``) that has not met the rows yet: a row's own position where
it meets them on their axis, a class or a token position (as many as the rows,
by chance) where it meets them on another (``fleet.semantics._row_tags.met``). A rule gets
the equation and its inputs' tags, returns its outputs' tags, and asks the walk
(``walk.refuse``, ``walk.reorder``, ``walk.combine``) where the rows meet other
rows. Reordering the rows alone is harmless (every row's value is still its own,
and a mean over them the same); a reordered value that meets the rows in another
order pairs different rows, which the walk refuses.
"""

from __future__ import annotations

from typing import Any

from fleet.semantics._jaxpr_scope import KEEPS_VALUE
from fleet.semantics._row_blocks import Blocks, is_blocks
from fleet.semantics._row_linalg import LINALG_RULES
from fleet.semantics._row_tags import PARTIAL, UNKNOWN, Row, is_row


def _along(op: str):
    """A rule for an operation that reorders or mixes rows along the row axis."""
    def rule(walk: Any, eqn: Any, ins: list) -> list:
        rows = [t for t in ins if is_row(t)]
        if not rows or any(not is_row(t) and t is not None for t in ins):
            return [UNKNOWN if ins[0] is not None else None] * len(eqn.outvars)
        t, p = rows[0], eqn.params
        axis = {"rev": lambda: t.axis if t.axis in p["dimensions"] else None,
                "sort": lambda: p["dimension"], "cumulative": lambda: p["axis"],
                "concatenate": lambda: p["dimension"],
                "pad": lambda: t.axis if tuple(p["padding_config"][t.axis]) != (0, 0, 0)
                else None}[op]()
        if axis != t.axis:
            if len({r.order for r in rows}) > 1 or len({r.axis for r in rows}) > 1:
                walk.refuse(eqn, "rows in different orders put side by side")
            return [t] * len(eqn.outvars)
        if op in ("cumulative", "pad"):
            walk.refuse(eqn, {"cumulative": "a cumulative sum or product over the rows",
                              "pad": "rows padded"}[op])
        if op == "rev":
            return [walk.reorder(eqn, Row(t.axis, ("rev", t.order)),
                                 "the rows reversed (x[::-1], jnp.flip)")]
        if op == "sort":
            new = walk.reorder(eqn, Row(t.axis, ("sort", id(eqn))),
                               "the rows reordered by a sort over them (jnp.sort, "
                               "jnp.argsort, jax.random.permutation)")
            return [new] * len(eqn.outvars)
        order = ("concat", tuple(getattr(x, "order", None) for x in ins),
                 tuple(v.aval.shape[t.axis] for v in eqn.invars))
        return [walk.reorder(eqn, Row(t.axis, order),
                             "rows concatenated (jnp.concatenate over the batch)")]
    return rule


def _slice(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    if not is_row(t):
        return [t]
    size, out = eqn.invars[0].aval.shape[t.axis], eqn.outvars[0].aval.shape[t.axis]
    if out != size:
        walk.refuse(eqn, f"some of the rows taken ({out} of {size}: x[:k], jnp.roll; for "
                         "micro-batches set strategy.gradient_merge, or scan over "
                         "x.reshape(k, -1, ...) accumulating the gradients)")
    return [t]


def _split(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    if is_row(t) and t.axis == eqn.params["axis"]:
        walk.refuse(eqn, "the rows split (jnp.split over the batch)")
    return [t] * len(eqn.outvars)


def _top_k(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    if is_row(t) and t.axis == eqn.params.get("axis", eqn.invars[0].aval.ndim - 1):
        walk.refuse(eqn, "the top rows picked (jax.lax.top_k over the rows)")
    return [t] * len(eqn.outvars)


def _windowed(walk: Any, eqn: Any, ins: list) -> list:
    """Pooling (``reduce_window``) and its gradient: row-wise when its window
    does not span the rows, refused where it does."""
    t = next((x for x in ins if x is not None), None)
    if not is_row(t) or any(x not in (None, t) for x in ins):
        return [UNKNOWN] * len(eqn.outvars)
    if eqn.params["window_dimensions"][t.axis] == 1:
        return [t] * len(eqn.outvars)
    walk.refuse(eqn, "a pooling window sliding over the rows (nnx.avg_pool, nnx.max_pool "
                     "with the batch as a spatial axis)")
    return [UNKNOWN] * len(eqn.outvars)


def _conv(walk: Any, eqn: Any, ins: list) -> list:
    lt, rt = ins[:2]
    p = eqn.params
    dn = p["dimension_numbers"]
    if is_row(lt) and rt is None and lt.axis == dn.lhs_spec[0]:
        return [Row(dn.out_spec[0], lt.order)]
    if is_row(lt) and is_row(rt) and lt.order == rt.order and (lt.axis, rt.axis) == (
            dn.lhs_spec[1], dn.rhs_spec[1]):
        return [PARTIAL]  # (a kernel's gradient: the rows contracted)
    if is_row(lt) and rt is None and lt.axis in dn.lhs_spec[2:]:
        k = dn.lhs_spec.index(lt.axis) - 2  # (the rows as the k-th spatial axis)
        if eqn.invars[1].aval.shape[dn.rhs_spec[2 + k]] > 1:
            walk.refuse(eqn, "a convolution sliding over the rows (nnx.Conv, jnp.convolve with "
                             "the batch as a spatial axis: each output row mixes its "
                             "neighbours)")
        if (p["window_strides"][k], p["lhs_dilation"][k], tuple(p["padding"][k])) == (1, 1, (0, 0)):
            return [Row(dn.out_spec[2 + k], lt.order)]
    # (rows on the input channels: a kernel's gradient whose cotangent came out of
    # one of fleet's calls untagged, as a synced BatchNorm's does; not followed)
    return [UNKNOWN]


def _gather(walk: Any, eqn: Any, ins: list) -> list:
    t, idx = ins[0], ins[1]
    dn = eqn.params["dimension_numbers"]
    out_batch = [d for d in range(eqn.outvars[0].aval.ndim) if d not in dn.offset_dims]
    if PARTIAL in (t, idx) and (is_row(t) or is_row(idx)):  # (counts[y], a class's mean)
        return [walk.combine(eqn)]
    if is_row(t) and t.axis in dn.operand_batching_dims:  # (take_along_axis: row by row)
        j = dn.operand_batching_dims.index(t.axis)
        if not is_row(idx) or idx.axis != dn.start_indices_batching_dims[j]:
            return [UNKNOWN]
        if idx.order != t.order:
            walk.refuse(eqn, "rows indexed by the rows of another order")
        return [Row(out_batch[idx.axis], t.order)]
    if is_row(t) and t.axis in dn.start_index_map:
        if len(out_batch) != 1:
            walk.refuse(eqn, "some rows picked by index (x[0], jnp.take over the rows)")
        if is_row(idx):  # (x[jnp.arange(n), y]: each row's own; x[perm]: perm's order)
            if idx.order == 0 and not own_index(walk, eqn.invars[1],
                                                dn.start_index_map.index(t.axis)):
                walk.refuse(eqn, "rows picked by indices that come from the batch (x[i] with "
                                 "i a batch value: each replica's i picks among its own rows)"
                            + _table_hint(walk.sources.get(id(eqn.invars[0]))))
            return [Row(out_batch[0], idx.order)]
        if idx is None:
            return [walk.reorder(eqn, Row(out_batch[0], ("gather", id(eqn.invars[1]))),
                                 "rows picked by index (x[idx] over the rows; x[perm], "
                                 "perm from jax.random.permutation)")]
        return [UNKNOWN]
    if is_row(t):
        if idx is not None or t.axis in dn.operand_batching_dims or (
                eqn.params["slice_sizes"][t.axis] != eqn.invars[0].aval.shape[t.axis]):
            return [UNKNOWN]  # (take_along_axis: row by row, not followed)
        kept = [d for d in range(eqn.invars[0].aval.ndim)
                if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
        return [Row(dn.offset_dims[kept.index(t.axis)], t.order)]
    if is_row(idx) and idx.axis < eqn.invars[1].aval.ndim - 1 and idx.axis < len(out_batch):
        return [Row(out_batch[idx.axis], idx.order)]  # (an embedding of each row's ids)
    return [UNKNOWN]


def _table_hint(source: str | None) -> str:
    """For rows picked from a step's argument itself: that it may be no batch data."""
    if source is None:
        return ""
    return (f"; the rows picked are {source}'s, split over the replicas as batch data: if "
            f"it is a table (class weights, an embedding), pass distributed_step(fn, "
            f"batch_argnums=...) naming only the batch's positions, and it reaches every "
            f"replica whole")


def _scatter(walk: Any, eqn: Any, ins: list) -> list:
    """``x.at[i].add(u)`` and its kin: row by row where the rows ride a batching or
    a whole window dimension (take_along_axis's gradient); combined into the operand
    where each row lands at its index (``jnp.bincount``, an embedding's gradient):
    partial, as a sum over the rows."""
    to, ti, tu = ins[:3]
    dn = eqn.params["dimension_numbers"]
    rows = [t for t in (to, ti, tu) if is_row(t)]
    if not rows:
        return [PARTIAL]
    if PARTIAL in (to, ti, tu):
        return [walk.combine(eqn)]
    order = rows[0].order
    if any(r.order != order for r in rows):
        walk.refuse(eqn, "rows written at the rows of another order")
    scatter_dims = [d for d in range(eqn.invars[2].aval.ndim) if d not in dn.update_window_dims]
    if is_row(ti) and ti.axis in dn.scatter_indices_batching_dims:
        axis = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(ti.axis)]
        ok = to in (None, Row(axis, order)) and tu in (None, Row(scatter_dims[ti.axis], order))
        return [Row(axis, order) if ok else UNKNOWN]
    if ti is None and is_row(tu) and tu.axis in dn.update_window_dims:
        window = [d for d in range(eqn.invars[0].aval.ndim)
                  if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
        axis = window[dn.update_window_dims.index(tu.axis)]
        whole = eqn.invars[2].aval.shape[tu.axis] == eqn.invars[0].aval.shape[axis]
        return [Row(axis, order) if whole and to in (None, Row(axis, order)) else UNKNOWN]
    if to is None and is_row(ti) and ti.axis < eqn.invars[1].aval.ndim - 1 and (
            tu is None or tu.axis == scatter_dims[ti.axis]):
        shape = eqn.invars[0].aval.shape
        for k, axis in enumerate(dn.scatter_dims_to_operand_dims):
            if shape[axis] in walk.rows and own_index(walk, eqn.invars[1], k):
                return [Row(axis, order)]  # (x[jnp.arange(n), y]'s gradient: each row's own)
    landing = ti is None or ti.axis < eqn.invars[1].aval.ndim - 1
    if to is None and landing and (tu is None or tu.axis in scatter_dims) and (
            ti is None or tu is None or scatter_dims[ti.axis] == tu.axis):
        return [PARTIAL]
    return [UNKNOWN]


def own_index(walk: Any, v: Any, k: int | None = None) -> bool:
    """Whether ``v`` (with ``k``: component ``k`` of its last axis, an index
    vector) is each row's own index, ``jnp.arange`` over the rows: an ``iota``
    along an axis of the rows' size, through casts, reshapes, broadcasts, the
    concatenation that stacks index columns, and jnp's wrap of negative indices
    (``select_n(i < 0, i, i + n)``)."""
    for _ in range(64):
        eqn = walk.producer.get(id(v))
        if eqn is None:
            return False
        name = eqn.primitive.name
        if name == "iota":
            return eqn.outvars[0].aval.shape[eqn.params.get("dimension", 0)] in walk.rows
        if k is not None and name == "concatenate" and (
                eqn.params["dimension"] == eqn.outvars[0].aval.ndim - 1):
            for x in eqn.invars:
                width = x.aval.shape[-1]
                if k < width:
                    v = x
                    break
                k -= width
            if width != 1:
                return False
            k = None
            continue
        if name == "select_n" and len(eqn.invars) == 3:  # (the wrap of negative indices)
            wrapped = walk.producer.get(id(eqn.invars[2]))
            if (wrapped is None or wrapped.primitive.name != "add"
                    or wrapped.invars[0] is not eqn.invars[1]):
                return False
            v = eqn.invars[1]
            continue
        if name not in KEEPS_VALUE or len(eqn.invars) != 1:
            return False
        v = eqn.invars[0]
    return False


def _dot(walk: Any, eqn: Any, ins: list) -> list:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lt, rt = ins
    if PARTIAL in ins:
        if any(map(is_row, ins)):  # (rows times the batch's own statistics)
            return [walk.combine(eqn)]
        return [PARTIAL if None in ins else UNKNOWN]
    lfree = [d for d in range(eqn.invars[0].aval.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(eqn.invars[1].aval.ndim) if d not in rc and d not in rb]
    if is_row(lt) and is_row(rt):
        if lt.axis in lfree and rt.axis in rfree:
            walk.refuse(eqn, "a product of every row with every row (z @ z.T: a "
                             "contrastive loss's similarity matrix)")
        if lt.order != rt.order:
            walk.refuse(eqn, "rows multiplied with rows in another order")
        if lt.axis in lb and rt.axis in rb and lb.index(lt.axis) == rb.index(rt.axis):
            return [Row(lb.index(lt.axis), lt.order)]
        if lt.axis in lc and rt.axis in rc and lc.index(lt.axis) == rc.index(rt.axis):
            return [PARTIAL]  # (rows contracted: a gradient's sum over the rows)
        return [UNKNOWN]
    t, side, free, batch, contract = ((lt, 0, lfree, lb, lc) if is_row(lt)
                                      else (rt, 1, rfree, rb, rc))
    if t.axis in contract:
        return [PARTIAL]
    if t.axis in batch:
        return [Row(batch.index(t.axis), t.order)]
    return [Row(len(lb) + (0 if side == 0 else len(lfree)) + free.index(t.axis), t.order)]


def _broadcast(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    return [Row(eqn.params["broadcast_dimensions"][t.axis], t.order) if is_row(t) else t]


def _transpose(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    return [Row(list(eqn.params["permutation"]).index(t.axis), t.order) if is_row(t) else t]


def _squeeze(walk: Any, eqn: Any, ins: list) -> list:
    t, dims = ins[0], eqn.params["dimensions"]
    if not is_row(t):
        return [t]
    return [UNKNOWN if t.axis in dims else Row(t.axis - sum(d < t.axis for d in dims), t.order)]


def _reshape(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    old, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if is_row(t) and old[:t.axis + 1] != tuple(new[:t.axis + 1]):
        if (tuple(old), tuple(new)) in walk.blocks:  # (the single-device step's blocks)
            return [Blocks(t.axis)]
        return [UNKNOWN]  # (the rows split or merged: not followed)
    return [t]


_BLOCK_PICKED = ("a block of the rows picked (x.reshape(k, -1, ...)[i]: micro-batches): each "
                 "replica's block i is of its own rows, the single-device step's of the "
                 "global batch's; for an update per micro-batch take every k-th row, "
                 "x.reshape(-1, k, ...).swapaxes(0, 1), whose block i is the same rows on one "
                 "device and on the replicas together; to accumulate them set "
                 "strategy.gradient_merge (or sum the gradients over a scan of the blocks "
                 "and update once)")


def blocks_rule(walk: Any, eqn: Any, ins: list) -> list:
    """An equation with a :class:`Blocks` input: refused where it picks some of
    the blocks, else not followed."""
    t, name, p = ins[0], eqn.primitive.name, eqn.params
    if not is_blocks(t):  # (the blocks are not what is picked from)
        picked = False
    elif name in ("slice", "dynamic_slice"):
        picked = eqn.outvars[0].aval.shape[t.axis] != eqn.invars[0].aval.shape[t.axis]
    elif name == "gather":
        picked = t.axis in p["dimension_numbers"].start_index_map
    else:  # (unstack: iterating over them, jax 0.12)
        picked = name in ("split", "unstack") and p["axis"] == t.axis
    if picked:
        walk.refuse(eqn, _BLOCK_PICKED)
    return [UNKNOWN] * len(eqn.outvars)


CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
SCATTERS = ("scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub", "scatter-mul",
            "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max")
RULES = {
    "rev": _along("rev"), "sort": _along("sort"), "concatenate": _along("concatenate"),
    "pad": _along("pad"), **{name: _along("cumulative") for name in CUMULATIVE},
    "slice": _slice, "dynamic_slice": _slice, "split": _split, "top_k": _top_k,
    "gather": _gather, **{name: _scatter for name in SCATTERS}, "dot_general": _dot,
    "conv_general_dilated": _conv,
    **{name: _windowed for name in ("reduce_window_sum", "reduce_window_max",
                                    "reduce_window_min", "reduce_window",
                                    "select_and_scatter_add", "select_and_gather_add")},
    "broadcast_in_dim": _broadcast, "transpose": _transpose, "squeeze": _squeeze,
    "reshape": _reshape, **LINALG_RULES,
}
