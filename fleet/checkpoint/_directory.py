"""``fleet.load`` of an orbax PyTree directory, with orbax's public API.

Two kinds of directory are read:

* a checkpoint written by ``fleet.save`` before it wrote its own file (fleet
  up to issue 19): an orbax PyTree checkpoint (``_METADATA``, arrays in
  tensorstore's OCDBT format) with ``fleet_checksums.json``,
  ``{"algorithm": "crc32", "arrays": {keystr: crc32}}`` (absent in the very
  first version);
* one part of a :class:`fleet.CheckpointManager` step (``ckpt/100/model``); its
  checksums are in the step's ``meta/metadata`` JSON, ``"checksums": {part:
  {dotted key: {shard index: crc32}}}``.

Arrays come back as numpy arrays, numbers and strings as Python values, lists
and dicts as written (tuples as lists). Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from fleet.checkpoint._errors import FleetCheckpointError

CHECKSUMS = "fleet_checksums.json"
METADATA = "_METADATA"  # orbax's PyTree metadata, in every such directory


def is_pytree(path: str) -> bool:
    """Whether the directory ``path`` holds an orbax PyTree checkpoint."""
    return os.path.isfile(os.path.join(path, METADATA))


def _restore_args(m: Any) -> ocp.RestoreArgs:
    arrays = isinstance(m, ocp.metadata.ArrayMetadata) and not isinstance(
        m, ocp.metadata.ScalarMetadata)
    return ocp.RestoreArgs(restore_type=np.ndarray if arrays else None)


def read(path: str) -> Any:
    """The tree in the orbax PyTree directory ``path``, read by this process alone."""
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=alone)
    checkpointer = ocp.Checkpointer(handler, multiprocessing_options=alone)
    try:
        try:
            tree = handler.metadata(epath.Path(path)).tree
        except (FileNotFoundError, ValueError) as e:
            raise FleetCheckpointError(
                f"fleet.load: {path} is not a checkpoint written by fleet.save ({e})"
            ) from None
        restore_args = jax.tree.map(_restore_args, tree)
        try:
            return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                restore_args=restore_args))
        except Exception as e:  # noqa: BLE001 (tensorstore's errors on a damaged file)
            raise FleetCheckpointError(
                f"fleet.load: {path} is damaged: {str(e).splitlines()[0][:500]}"
            ) from None
    finally:
        checkpointer.close()


def stored_sums(path: str) -> dict[str, dict[str | None, int]] | None:
    """The checksums written with the directory ``path``, ``{keystr: {shard index:
    crc}}`` (``None`` for the whole array), or ``None`` if there are none: the old
    fleet.save's file, or for one part of a CheckpointManager step its ``meta``."""
    own = os.path.join(path, CHECKSUMS)
    if os.path.exists(own):
        try:
            with open(own) as f:
                arrays = json.load(f)["arrays"]
            return {k: {None: int(crc)} for k, crc in arrays.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FleetCheckpointError(
                f"fleet.load: {path} is damaged: its {CHECKSUMS} cannot be read ({e})") from None
    meta = os.path.join(os.path.dirname(path), "meta", "metadata")
    try:
        with open(meta) as f:
            sums = json.load(f)["checksums"][os.path.basename(path)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {jax.tree_util.keystr((jax.tree_util.DictKey(k),)): v for k, v in sums.items()}
