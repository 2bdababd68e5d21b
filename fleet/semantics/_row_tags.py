"""The tags of :mod:`fleet.semantics._row_mixing`'s walk: how a value holds the
replica's batch rows (the rules: :mod:`fleet.semantics._row_rules`).

A :class:`Row` is a value with the rows along ``axis``, in ``order`` (``0``: the
batch's own); :data:`PARTIAL` a value reduced over the rows (a sum, a mean, a
maximum, or any value computed from such values alone); :data:`UNKNOWN` a value
the walk does not follow; an :class:`Index` an index as long as the replica's
rows that has not met them yet. Untagged values do not depend on the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fleet.semantics._row_blocks import Blocks, is_blocks

PARTIAL, UNKNOWN = "partial", "unknown"


class Row(NamedTuple):
    axis: int
    order: Any = 0  # (0: the batch's own order)


class Index(NamedTuple):
    axis: int


def is_row(t: Any) -> bool:
    return isinstance(t, Row)


def is_index(t: Any) -> bool:
    return isinstance(t, Index)


def unstacked(t: Any) -> Any:
    """A scanned input's tag inside the body: one step of its leading axis."""
    if is_index(t):
        return None if t.axis == 0 else Index(t.axis - 1)
    if is_blocks(t):  # (a scan over the blocks: not followed)
        return UNKNOWN if t.axis == 0 else Blocks(t.axis - 1)
    if not is_row(t):
        return t
    return UNKNOWN if t.axis == 0 else Row(t.axis - 1, t.order)


def stacked(t: Any) -> Any:
    return t._replace(axis=t.axis + 1) if is_row(t) or is_index(t) or is_blocks(t) else t


def met(ins: list) -> list:
    """Inputs' tags with each :class:`Index` resolved where the rows are among them:
    a row's own position on their axis (``jnp.sort(z) * jnp.arange(n)``), a constant
    on another (a class index as long as the rows: ``y[:, None] == jnp.arange(c)``;
    a token position embedded and added to each row)."""
    axes = {t.axis for t in ins if is_row(t)}
    if not axes and PARTIAL not in ins and UNKNOWN not in ins:
        return ins
    return [(Row(t.axis) if t.axis in axes else None) if is_index(t) else t for t in ins]
