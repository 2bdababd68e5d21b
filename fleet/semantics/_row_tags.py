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
