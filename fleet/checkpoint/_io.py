"""``fleet.save`` / ``fleet.load``: Paddle's ``paddle.save`` / ``paddle.load`` for
state dicts (their docstrings say how they are called).

The file is a zip archive of ``.npy`` arrays and a JSON tree with the CRC-32 of
every array (:mod:`fleet.checkpoint._file` gives the format precisely), written
atomically (:mod:`fleet.checkpoint._atomic`). ``fleet.load`` verifies every
checksum, naming the array that does not match; one that says it was written
with checksums and lacks one is damaged, never read unchecked.

``fleet.load`` also reads the orbax PyTree directories (``_METADATA``, arrays in
tensorstore's OCDBT format) this fleet wrote, with orbax's public API:

* a checkpoint written by ``fleet.save`` before it wrote its own file (fleet up
  to issue 19), with ``fleet_checksums.json``, ``{"algorithm": "crc32",
  "arrays": {keystr: crc32}}`` (absent in the very first version, whose
  directories nothing tells from one whose file was deleted: those load unchecked);
* one part of a :class:`fleet.CheckpointManager` step (``ckpt/100/model``); its
  checksums are in the step's ``meta/metadata`` JSON, ``"checksums": {part:
  {dotted key: {shard index: crc32}}}``.

Their arrays come back as numpy arrays, numbers and strings as Python values,
lists and dicts as written (tuples as lists).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from fleet.checkpoint import _atomic, _file, _integrity, _settle, _tree
from fleet.checkpoint._errors import FleetCheckpointError, first_line
from fleet.runtime._leaves import first_replica

_LEAVES = "arrays, numpy or Python numbers, strings"
_CHECKSUMS = "fleet_checksums.json"  # (in a directory of the earlier fleet.save)
_METADATA = "_METADATA"  # orbax's PyTree metadata, in every such directory


def _host_leaf(path: tuple, x: Any) -> Any:
    """``x`` as written: a numpy array or a Python bool / int / float / complex / str."""
    where = jax.tree_util.keystr(path) or "the object"
    if isinstance(x, np.generic):  # (np.float64 and np.str_ are Python floats and strs too)
        value = x.item()
        if isinstance(value, (str, bool, int, float, complex)):
            return value
        raise FleetCheckpointError(
            f"fleet.save: {where} is a numpy {x.dtype} scalar; fleet.save takes dicts and lists "
            f"of {_LEAVES} (a state_dict()): make it an array or a number")
    if isinstance(x, (str, bool, int, float, complex)):
        return x
    if isinstance(x, jax.Array):
        if _tree.is_key(x):
            x = jax.random.key_data(x)
        try:
            x = first_replica(x)
        except ValueError:
            raise FleetCheckpointError(
                f"fleet.save: {where} is sharded over processes; fleet.save writes one "
                "process's values, use fleet.CheckpointManager for sharded state"
            ) from None
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject or x.dtype.fields is not None or x.dtype.name.startswith("void"):
            raise FleetCheckpointError(
                f"fleet.save: {where} is an array of {x.dtype} (objects or records); fleet.save "
                "writes arrays of numbers, booleans and strings, and never pickles")
        return x
    raise FleetCheckpointError(
        f"fleet.save: {where} is a {type(x).__name__}; "
        f"fleet.save takes dicts and lists of {_LEAVES} (a state_dict()), and never pickles"
    )


def _refuse_non_checkpoint(final: str) -> None:
    if os.path.isdir(final):
        entries = os.listdir(final)
        if entries and _METADATA not in entries and _CHECKSUMS not in entries:
            raise FleetCheckpointError(
                f"fleet.save: {final} is a directory that is not a checkpoint (it holds "
                f"{sorted(entries)[:5]}); fleet.save replaces only what fleet.save wrote: "
                "choose another path or remove it"
            )
    elif os.path.isfile(final):
        reason = _not_ours(final)
        if reason:
            raise FleetCheckpointError(
                f"fleet.save: {final} is a file that fleet.save did not write ({reason}); "
                "fleet.save replaces only what it wrote: choose another path or remove the file"
            )
    elif os.path.lexists(final):
        raise FleetCheckpointError(
            f"fleet.save: {final} is neither a file nor a directory; fleet.save writes a file: "
            "choose another path or remove it"
        )


def _not_ours(path: str) -> str:
    """Why the file ``path`` is not one fleet.save wrote ("" if it is: a newer
    fleet's counts)."""
    try:
        with open(path, "rb") as f:
            _file.read_doc(f)
    except (_file.NotFleetFile, _file.Damaged) as e:
        return str(e)
    except _file.Newer:
        pass
    return ""


def save(obj: Any, path: str | os.PathLike) -> None:
    """Writes ``obj`` (a state dict) to the file ``path``, replacing it if present.

    Not a collective call: it runs on the calling process alone, which writes
    all of ``obj``, on any rank. Several processes may save to one path at once:
    ``path`` always holds one complete checkpoint. It refuses a ``path`` that is
    a file or a directory fleet.save did not write. A directory at ``path`` that
    holds a checkpoint of the earlier fleet.save (an orbax directory) is
    replaced by the file, in one atomic swap on Linux (elsewhere it is moved
    aside first, so a crash at that moment leaves ``path`` empty and the old
    checkpoint under ``.NAME.fleet-old-*`` beside it). The temporary files
    (``.NAME.fleet-new-*``) that writers killed while saving to ``path`` left
    are removed; those of live writers are kept.

    Args:
        obj: nested dicts / lists of arrays (jax or numpy), numbers and strings,
            such as ``model.state_dict()``. Replicated ``jax.Array`` s are written
            once, from this process's first copy; PRNG keys as their key data.
            Tuples load as lists, numpy scalars as Python numbers.
        path: a file name (``"model.pdparams"``); its directory is created.

    Raises:
        FleetCheckpointError: ``obj`` holds something else, or ``path`` is a file
            or directory of something else. Disk full, or a directory that is
            read-only or not writable: the message says so and names it; the
            previous checkpoint at ``path`` is left as it was.

    Example:
        >>> fleet.save(model.state_dict(), "model.pdparams")  # doctest: +SKIP
        >>> model.set_state_dict(fleet.load("model.pdparams"))
    """
    tree = _file.encode(obj, _host_leaf)
    final = os.path.abspath(os.fspath(path))
    _refuse_non_checkpoint(final)
    _atomic.write(final, tree)


def load(path: str | os.PathLike) -> Any:
    """Reads what :func:`save` wrote: the same nesting, arrays as numpy.

    Not a collective call. Loading reads arrays and JSON only; nothing in the
    file is executed or unpickled. Every array's checksum is verified. Also
    reads a checkpoint of the earlier fleet.save (a directory), and one part of
    a :class:`fleet.CheckpointManager` step, e.g. ``fleet.load("ckpt/100/model")``
    is the model's state dict.

    Raises:
        FleetCheckpointError: ``path`` is not a checkpoint, or it is damaged (an
            array does not match its checksum: the message names it; the file
            is cut short or overwritten).

    Example:
        >>> state = fleet.load("model.pdparams")  # doctest: +SKIP
        >>> sorted(state)
        ['linear1.bias', 'linear1.kernel', ...]
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, _METADATA)):
            what = "an empty directory" if not os.listdir(path) else "a directory without _METADATA"
            raise FleetCheckpointError(
                f"fleet.load: {path} is not a checkpoint written by fleet.save ({what})")
        sums = _directory_sums(path)  # (before reading: a damaged table is named first)
        value = _read_directory(path)
        _verify(path, _arrays(value), sums or {}, every=sums is not None)
        return value
    if not os.path.isfile(path):
        raise FleetCheckpointError(
            f"fleet.load: {path} is not a checkpoint written by fleet.save (it does not exist)")
    try:
        value, sums, arrays = _file.read(path)
    except _file.NotFleetFile as e:
        raise FleetCheckpointError(
            f"fleet.load: {path} is not a checkpoint written by fleet.save ({e})") from None
    except _file.Damaged as e:
        raise FleetCheckpointError(f"fleet.load: {path} is damaged: {e}") from None
    except _file.Newer as e:
        raise FleetCheckpointError(
            f"fleet.load: {path} was written by a newer fleet ({e}); upgrade fleet") from None
    _verify(path, arrays, {k: {None: crc} for k, crc in sums.items()})
    return value


# --------------------------------------------------------------------------- orbax directories


def _restore_args(m: Any) -> ocp.RestoreArgs:
    arrays = isinstance(m, ocp.metadata.ArrayMetadata) and not isinstance(
        m, ocp.metadata.ScalarMetadata)
    return ocp.RestoreArgs(restore_type=np.ndarray if arrays else None)


def _read_directory(path: str) -> Any:
    """The tree in the orbax PyTree directory ``path``, read by this process alone."""
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    # (its reads settle: a damaged array leaves nothing running, fleet.checkpoint._settle)
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=alone,
                                          type_handler_registry=_settle.read_types())
    checkpointer = ocp.Checkpointer(handler, multiprocessing_options=alone)
    try:
        try:
            with _settle.collect() as failed:
                tree = handler.metadata(epath.Path(path)).tree
        except (FileNotFoundError, ValueError) as e:
            raise FleetCheckpointError(
                f"fleet.load: {path} is not a checkpoint written by fleet.save ({e})"
            ) from None
        if failed:
            raise FleetCheckpointError(f"fleet.load: {path} is damaged: the metadata of its "
                                       f"arrays cannot be read ({first_line(failed[0])})")
        restore_args = jax.tree.map(_restore_args, tree)
        try:
            with _settle.collect() as failed:
                value = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                    restore_args=restore_args))
            if failed:
                raise failed[0]
        except Exception as e:  # noqa: BLE001 (tensorstore's errors on a damaged file)
            raise FleetCheckpointError(
                f"fleet.load: {path} is damaged: {first_line(e)}") from None
        return value
    finally:
        checkpointer.close()


def _directory_sums(path: str) -> dict[str, dict[str | None, int]] | None:
    """The checksums written with the directory ``path``, ``{keystr: {shard index:
    crc}}`` (``None`` for the whole array), or ``None`` if there are none: the old
    fleet.save's file, or for one part of a CheckpointManager step its ``meta``."""
    own = os.path.join(path, _CHECKSUMS)
    if os.path.exists(own):
        try:
            with open(own) as f:
                arrays = json.load(f)["arrays"]
            return {k: {None: int(crc)} for k, crc in arrays.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FleetCheckpointError(
                f"fleet.load: {path} is damaged: its {_CHECKSUMS} cannot be read ({e})") from None
    meta = os.path.join(os.path.dirname(path), "meta", "metadata")
    if not os.path.isdir(os.path.dirname(meta)):
        return None  # (the very first fleet.save wrote no checksums)
    try:  # one part of a CheckpointManager step: its checksums are in the step's meta
        with open(meta) as f:
            doc = json.load(f)
        written = doc.get("checksum") is not None  # (steps before fleet summed arrays: None)
        sums = doc["checksums"][os.path.basename(path)] if written else {}
        if not _integrity.is_table(sums):
            raise TypeError(f"its table of {os.path.basename(path)!r} is not one")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FleetCheckpointError(
            f"fleet.load: {path} is damaged: the checksums of its step "
            f"({meta}) cannot be read ({first_line(e)})") from None
    if not written:
        return None
    return {jax.tree_util.keystr((jax.tree_util.DictKey(k),)): v for k, v in sums.items()}


# --------------------------------------------------------------------------- verification


def _arrays(tree: Any) -> dict[str, Any]:
    """``{keystr: array}`` of the array leaves of ``tree`` (what is checksummed)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): v for p, v in flat if isinstance(v, (np.ndarray, np.generic))}


def _verify(path: str, arrays: dict[str, Any], sums: dict[str, dict[str | None, int]],
            every: bool = False) -> None:
    """Raises if an array of ``arrays`` differs from its checksum in ``sums``
    (``{key: {shard index: crc}}``, ``None`` for the whole array), or, with
    ``every`` (it was written with a checksum for every array), has none."""
    stored = {k: {_integrity.whole(np.shape(arrays[k])) if i is None else i: crc
                  for i, crc in v.items()} for k, v in sums.items() if k in arrays}
    verdict = _integrity.damage(
        _integrity.mismatches(stored, arrays, quote=False),
        _integrity.missing(stored, arrays, quote=False) if every else [],
        ", though it was written with one for every array")
    if verdict:
        raise FleetCheckpointError(f"fleet.load: {path} is damaged: {verdict}")
