"""A step's ``meta`` item (its JSON, with the checksums of its arrays) and the
orbax handlers that write a step.

``directory/<step>/meta/metadata`` is the JSON of a step::

    {"format": "fleet-checkpoint", "version": 1, "step": 100, "epoch": 3,
     "metadata": {...}, "loader": {...} or null, "parts": ["model", ...],
     "key_impls": {part: {dotted key: "threefry2x32"}}, "processes": 2,
     "replicas": 8, "checksum": "crc32",
     "checksums": {part: {dotted key: {shard index: crc32}}}}

``checksum`` names the checksum every array of the step has (``null``: none,
as only ``benchmarks/checkpoint_io.py`` writes to time them); a step that names
one and lacks the table, or an array's entry in it, is damaged, never read
unchecked (:mod:`fleet.checkpoint._restore`). Steps written before fleet
summed arrays have no ``checksum`` key.

The checksums are summed in a background thread (``fleet-checksums``, one, so
the saves' tables come in the order of the saves) while orbax writes the
arrays; :class:`MetaHandler` writes the JSON once they are ready, in orbax's
commit thread, so ``save`` returns at once. With several processes each sums
the shards it writes and the tables are merged (:func:`fleet.runtime._agree.agree`).

Reading it (:func:`read`) tells a damaged step (:class:`Damaged`) from a
directory that is no fleet checkpoint, or one a newer fleet wrote.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fleet.checkpoint import _integrity, _settle, _state
from fleet.checkpoint._errors import Damaged, FleetCheckpointError, first_line
from fleet.runtime import _agree
from fleet.runtime._world import world

NAME = "meta"
_FILE = "metadata"  # (JsonCheckpointHandler's file name, which restore reads)
FORMAT = "fleet-checkpoint"
VERSION = 1

# Replicated arrays are written from replica 0 alone (process 0's first device),
# the copy ``state_dict()`` and ``fleet.save`` read. Orbax's default on CPU,
# replica-parallel writing, takes a different slice from each replica: the same
# bytes only if every replica holds the same values, which fleet's convention
# (process 0's first copy is the value) does not need to assume.
# Host values (numpy, numbers, process-local arrays) are numpy arrays, which orbax
# writes from process 0.
# Their reads settle before a failure leaves orbax (:mod:`fleet.checkpoint._settle`).
_TYPES = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, _settle.ArrayHandler(use_replica_parallel=False)),
    (np.ndarray, _settle.NumpyHandler()),
)

_SUMMER = ThreadPoolExecutor(1, thread_name_prefix="fleet-checksums")


def _sum_and_share(pieces: dict[str, list]) -> dict[str, _integrity.Sums]:
    """The checksum tables of a step's parts: this process's shards, merged with
    every other process's (in the order of the saves: one summing thread)."""
    sums = {name: _integrity.sum_pieces(p) for name, p in pieces.items()}
    if jax.process_count() > 1:
        got = _agree.agree("fleet.CheckpointManager.save(checksums)", json.dumps(sums))
        sums = {name: _integrity.merge([json.loads(g)[name] for g in got]) for name in sums}
    return sums


class MetaHandler(ocp.JsonCheckpointHandler):
    """Writes a step's JSON (``meta/metadata``, on process 0) once its checksums
    (a future) are summed, in orbax's commit thread: the save returns at once.

    It replaces only the public ``async_save`` (``save`` calls it) and returns the
    kind of commit future ``JsonCheckpointHandler`` returns
    (``ocp.future.CommitFutureAwaitingContractedSignals``: it waits for orbax's
    signal that the item's directory exists before writing)."""

    @classmethod
    def typestr(cls) -> str:
        """The handler's name in a step's ``_CHECKPOINT_METADATA`` (``item_handlers``):
        part of the layout of version 1, kept from where the class was then."""
        return "fleet.checkpoint._manager._MetaHandler"

    async def async_save(self, directory, item=None, args=None):
        x = args.item if args is not None else item

        async def write() -> None:
            value = x
            if isinstance(value.get("checksums"), Future):
                value = dict(value, checksums=await asyncio.wrap_future(value["checksums"]))
            if jax.process_index() == 0:
                (directory / _FILE).write_text(json.dumps(value))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="fleet_meta_save")]


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.JsonSave):
    """A step's JSON (``meta``), written by :class:`MetaHandler`."""


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.JsonRestore):
    """Reads a step's JSON (``meta``)."""


def registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of a step's items: one PyTree item per array part, and ``meta``."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name in _state.ARRAY_PARTS:
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_TYPES)
        registry.add(name, ocp.args.PyTreeSave, handler)
        registry.add(name, ocp.args.PyTreeRestore, handler)
    meta = MetaHandler()
    registry.add(NAME, MetaSave, meta)
    registry.add(NAME, MetaRestore, meta)
    return registry


def build(step: int, epoch: Any, metadata: Any, loader: Any,
          parts: dict[str, _state.Part], pieces: dict[str, list]) -> dict[str, Any]:
    """The JSON of ``step`` (``epoch``, ``metadata`` and the loader's position
    checked to be JSON); its checksums, a future, are summed from ``pieces``
    (:func:`fleet.checkpoint._integrity.host_pieces`) in the background."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "epoch": _state.jsonable(epoch, "epoch"),
        "metadata": _state.jsonable(metadata or {}, "metadata"),
        "loader": None if loader is None else _state.loader_state(loader),
        "parts": sorted(parts),
        "key_impls": {name: p.impls() for name, p in parts.items()},
        "processes": jax.process_count(),
        "replicas": world().num_replicas,
        # Summed in the background while orbax writes the arrays; the JSON is
        # written once they are ready (MetaHandler).
        "checksums": _SUMMER.submit(_sum_and_share, pieces),
        # Which checksum every array has (None: none, as only benchmarks/checkpoint_io.py
        # writes to time them): a step that names one and lacks it is damaged.
        "checksum": _integrity.ALGORITHM if _integrity.ENABLED else None,
    }


def read(orbax: ocp.CheckpointManager, directory: str, step: int) -> dict[str, Any]:
    """The JSON of ``step``.

    Raises:
        Damaged: it is not readable JSON (cut short, missing).
        FleetCheckpointError: it is no fleet checkpoint, or a newer fleet's.
    """
    try:
        meta = orbax.restore(step, args=ocp.args.Composite(**{NAME: MetaRestore()}))[NAME]
    except Exception as e:  # noqa: BLE001 (JSON that does not parse, a missing file)
        raise Damaged(
            f"checkpoint {directory}/{step} is damaged: its {NAME!r} item is not "
            f"readable JSON ({first_line(e)}); restore another step"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FleetCheckpointError(
            f"{directory}/{step} is not a fleet checkpoint (its {NAME!r} item "
            f"is {type(meta).__name__}); write checkpoints with fleet.CheckpointManager"
        )
    if meta.get("version", 0) > VERSION:
        raise FleetCheckpointError(
            f"{directory}/{step} was written by a newer fleet (checkpoint version "
            f"{meta['version']}, this fleet reads up to {VERSION}); upgrade fleet"
        )
    return meta
