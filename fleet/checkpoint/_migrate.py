"""Optimizer state written by an earlier fleet, read under today's names: the
one place that knows the names it had.

Until issue 36 item 2 the distributed optimizer kept its strategy features'
state as variables at its top: gradient merge's ``merge_count``, float16 amp's
``loss_scaling``, ``good_steps``, ``bad_steps`` and ``skipped_steps``. They now
live in its ``fleet_state`` (:mod:`fleet.wrappers._fleet_state`), so a
checkpoint names them ``fleet_state.merge.mini_step``,
``fleet_state.amp.loss_scaling``... A checkpoint (``fleet.CheckpointManager``)
or a ``fleet.Model`` ``.pdopt`` file holding an earlier name is read as if it
held today's: the values are the same arrays, bitwise; only their key changed.

Pure functions of key names: :func:`renames` says which stored keys stand for
which of today's leaves, :func:`as_today` renames a stored dict.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

#: An optimizer leaf's earlier name -> its name today.
RENAMED = {
    "merge_count": "fleet_state.merge.mini_step",
    "loss_scaling": "fleet_state.amp.loss_scaling",
    "good_steps": "fleet_state.amp.good_steps",
    "bad_steps": "fleet_state.amp.bad_steps",
    "skipped_steps": "fleet_state.amp.skipped_steps",
}

#: The parts of a checkpoint that hold an optimizer's variables.
OPTIMIZER_PARTS = ("optimizer",)


def renames(part: str, stored: Collection[str], wanted: Collection[str]) -> dict[str, str]:
    """``{today's key: the stored key}`` for the leaves of ``wanted`` (today's
    keys of the object restored into part ``part``) that ``stored`` (the keys
    written) holds under their earlier name only."""
    if part not in OPTIMIZER_PARTS:
        return {}
    return {new: old for old, new in RENAMED.items()
            if old in stored and new in wanted and new not in stored}


def as_today(stored: Mapping[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    """``stored`` with the keys of ``renamed`` (``{today's: stored}``) under today's names."""
    earlier = {old: new for new, old in renamed.items()}
    return {earlier.get(k, k): v for k, v in stored.items()}
