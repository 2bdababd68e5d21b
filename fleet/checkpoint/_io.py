"""``fleet.save`` / ``fleet.load``: Paddle's ``paddle.save`` / ``paddle.load`` for state dicts.

``fleet.save(model.state_dict(), "model.pdparams")`` writes an orbax PyTree
checkpoint, a directory, from the calling process alone: it is not a collective
call, so ``if fleet.is_first_worker(): fleet.save(...)`` is fine, and so are
saves from any other rank, or from every rank to one path (each writes the full
data; the last one to finish is what stays). ``fleet.load`` returns the same
nesting with numpy arrays; it reads arrays and JSON only and never unpickles.

The write is atomic: the new checkpoint is written under a temporary name, with
a CRC-32 of every array (``fleet_checksums.json``), and swapped in at ``path``
in one rename; a crash leaves either the old or the new checkpoint there.
``fleet.load`` verifies every checksum and raises
:class:`FleetCheckpointError`, naming the array, on a mismatch.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import glob
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handlers as th

from fleet.checkpoint import _integrity, _tree
from fleet.checkpoint._errors import FleetCheckpointError

_LEAVES = "arrays, numpy or Python numbers, strings"
CHECKSUMS = "fleet_checksums.json"
_SUMMER = ThreadPoolExecutor(1, thread_name_prefix="fleet-save-checksums")  # beside the write


# --------------------------------------------------------------------------- writing from any process
# orbax's numpy, scalar and string handlers write only on process 0 (they expect
# every process to save the same tree); fleet.save writes from whichever process
# calls it.

async def _write_numpy(self, values, infos, args=None):
    coros = []
    for value, info, arg in zip(values, infos, args or [ocp.SaveArgs()] * len(values)):
        await info.await_path_creation()
        spec = ts_utils.build_array_write_spec(
            info=info, arg=arg, global_shape=value.shape, local_shape=value.shape,
            dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(
                use_ocdbt=info.is_ocdbt_checkpoint,
                override_ocdbt_process_id=self._override_ocdbt_process_id),
            metadata_key=self._metadata_key)
        coros.append(self._open_and_write(value, spec.json, info.ts_context))
    await asyncio.gather(*coros)


async def _write_strings(self, values, infos):
    import tensorstore as ts

    txn = ts.Transaction()
    writes = []
    for value, info in zip(values, infos):
        await info.await_path_creation()
        t = await ts.open(self._get_json_tspec(info), open=True, context=self._ts_context)
        writes.append(t.with_transaction(txn).write(value))
    await asyncio.gather(*writes)
    await txn.commit_async()


class _NumpyHandler(th.NumpyHandler):
    _background_serialize = _write_numpy


class _ScalarHandler(th.ScalarHandler):
    _background_serialize = _write_numpy


class _StringHandler(th.StringHandler):
    _background_serialize = _write_strings


def _local_checkpointer() -> tuple[ocp.Checkpointer, ocp.PyTreeCheckpointHandler]:
    """An orbax checkpointer (and its handler) that runs on this process alone,
    with no barrier with the other processes, and writes every value itself."""
    me = jax.process_index()
    local = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    registry = ocp.type_handlers.create_type_handler_registry(
        (int, _ScalarHandler()), (float, _ScalarHandler()), (bytes, _ScalarHandler()),
        (np.number, _ScalarHandler()), (np.ndarray, _NumpyHandler()), (str, _StringHandler()),
        (type(th.PLACEHOLDER), th.PlaceholderHandler()),
        (jax.Array, th.ArrayHandler()),  # (read only: a CheckpointManager part)
    )
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=local,
                                          type_handler_registry=registry)
    return ocp.Checkpointer(handler, multiprocessing_options=local), handler


def _host_leaf(path: tuple, x: Any) -> Any:
    if isinstance(x, (str, bool, int, float, np.ndarray, np.generic)):
        return x
    if isinstance(x, jax.Array):
        if _tree.is_key(x):
            x = jax.random.key_data(x)
        try:
            return _tree.host_value(x)
        except ValueError:
            raise FleetCheckpointError(
                f"fleet.save: {jax.tree_util.keystr(path)} is sharded over processes; "
                "fleet.save writes one process's values, use fleet.CheckpointManager for "
                "sharded state"
            ) from None
    raise FleetCheckpointError(
        f"fleet.save: {jax.tree_util.keystr(path) or 'the object'} is a {type(x).__name__}; "
        f"fleet.save takes dicts and lists of {_LEAVES} (a state_dict()), and never pickles"
    )


def _arrays(tree: Any) -> dict[str, Any]:
    """``{keystr: array}`` of the array leaves of ``tree`` (what is checksummed)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): v for p, v in flat if isinstance(v, (np.ndarray, np.generic))}


# --------------------------------------------------------------------------- the final rename

_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Swaps the directories ``a`` and ``b`` atomically (Linux ``renameat2``);
    ``False`` where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOENT):  # no such call, or b vanished
        return False
    raise OSError(code, os.strerror(code), b)


def _put_in_place(fresh: str, final: str, tag: str) -> None:
    """Moves the complete checkpoint ``fresh`` to ``final``, replacing what is there;
    ``final`` always holds a complete checkpoint, even with several processes
    saving to it at once."""
    while True:
        try:
            os.rename(fresh, final)  # nothing there yet
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if _exchange(fresh, final):  # fresh now holds the previous checkpoint
            shutil.rmtree(fresh, ignore_errors=True)
            return
        old = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.fleet-old-{tag}")
        try:
            os.rename(final, old)
        except FileNotFoundError:
            continue  # another process moved it away: try again
        try:
            os.rename(fresh, final)
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return


def _refuse_non_checkpoint(final: str) -> None:
    if os.path.isdir(final):
        entries = os.listdir(final)
        if entries and "_METADATA" not in entries and CHECKSUMS not in entries:
            raise FleetCheckpointError(
                f"fleet.save: {final} is a directory that is not a checkpoint (it holds "
                f"{sorted(entries)[:5]}); fleet.save replaces only what fleet.save wrote: "
                "choose another path or remove it"
            )
    elif os.path.lexists(final):
        raise FleetCheckpointError(
            f"fleet.save: {final} is a file, not a checkpoint; fleet.save writes a directory "
            "and never replaces a file: choose another path or remove the file"
        )


def save(obj: Any, path: str | os.PathLike) -> None:
    """Writes ``obj`` (a state dict) to the directory ``path``, replacing it if present.

    Not a collective call: it runs on the calling process alone, which writes
    all of ``obj``, on any rank. It refuses a ``path`` that is a regular file,
    or a directory fleet.save did not write.

    Args:
        obj: nested dicts / lists of arrays (jax or numpy), numbers and strings,
            such as ``model.state_dict()``. Replicated ``jax.Array`` s are written
            once, from this process's first copy; PRNG keys as their key data.
        path: a directory (created; Paddle's ``"model.pdparams"`` names work).

    Raises:
        FleetCheckpointError: ``obj`` holds something else, or ``path`` is a file
            (or a directory of something else). Disk full: the message says
            "disk full at DIR"; the previous checkpoint at ``path`` is left as it was.

    Example:
        >>> fleet.save(model.state_dict(), "model.pdparams")  # doctest: +SKIP
        >>> model.set_state_dict(fleet.load("model.pdparams"))
    """
    tree = jax.tree_util.tree_map_with_path(_host_leaf, obj)
    final = os.path.abspath(os.fspath(path))
    _refuse_non_checkpoint(final)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    tag = f"{jax.process_index()}-{uuid.uuid4().hex[:8]}"
    fresh = os.path.join(parent, f".{name}.fleet-new-{tag}")
    checkpointer, _ = _local_checkpointer()
    summing = _SUMMER.submit(_integrity.checksums, _arrays(tree), alone=True)
    try:
        checkpointer.save(fresh, args=ocp.args.PyTreeSave(tree))  # (while summing runs)
        sums = {k: next(iter(v.values())) for k, v in summing.result().items()}
        with open(os.path.join(fresh, CHECKSUMS), "w") as f:
            json.dump({"algorithm": _integrity.ALGORITHM, "arrays": sums}, f)
            f.flush()
            os.fsync(f.fileno())
        _put_in_place(fresh, final, tag)
    except Exception as e:
        for leftover in glob.glob(glob.escape(fresh) + "*"):  # (and orbax's own temporary name)
            shutil.rmtree(leftover, ignore_errors=True)
        if is_disk_full(e):
            raise FleetCheckpointError(
                f"fleet.save: disk full at {parent}: {final} was not written "
                f"({'the previous one is unchanged' if os.path.exists(final) else 'nothing is there'}); "
                "free space and save again"
            ) from None
        raise
    finally:
        checkpointer.close()


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is "no space left on device"."""
    while e is not None:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "os_error_code='28'" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _restore_args(m: Any) -> ocp.RestoreArgs:
    arrays = isinstance(m, ocp.metadata.ArrayMetadata) and not isinstance(
        m, ocp.metadata.ScalarMetadata)
    return ocp.RestoreArgs(restore_type=np.ndarray if arrays else None)


def _stored_sums(path: str) -> dict[str, dict[str, int]] | None:
    """The checksums written with ``path`` ({keystr: {index: crc}}), or ``None``:
    fleet.save's file, or for one part of a CheckpointManager step its ``meta``."""
    own = os.path.join(path, CHECKSUMS)
    if os.path.exists(own):
        with open(own) as f:
            arrays = json.load(f)["arrays"]
        return {k: {None: crc} for k, crc in arrays.items()}
    meta = os.path.join(os.path.dirname(path), "meta", "metadata")
    try:
        with open(meta) as f:
            sums = json.load(f)["checksums"][os.path.basename(path)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {jax.tree_util.keystr((jax.tree_util.DictKey(k),)): v for k, v in sums.items()}


def load(path: str | os.PathLike) -> Any:
    """Reads what :func:`save` wrote: the same nesting, arrays as numpy.

    Not a collective call. Loading reads arrays (tensorstore) and JSON only;
    nothing in the files is executed. Every array's checksum is verified. Also
    reads one part of a :class:`fleet.CheckpointManager` step, e.g.
    ``fleet.load("ckpt/100/model")`` is the model's state dict.

    Raises:
        FleetCheckpointError: ``path`` is not a checkpoint, or it is damaged (an
            array does not match its checksum: the message names it; a file is
            missing or cut short).

    Example:
        >>> state = fleet.load("model.pdparams")  # doctest: +SKIP
        >>> sorted(state)
        ['linear1.bias', 'linear1.kernel', ...]
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FleetCheckpointError(
            f"fleet.load: {path} is not a directory written by fleet.save (it "
            f"{'is a file' if os.path.exists(path) else 'does not exist'})"
        )
    checkpointer, handler = _local_checkpointer()
    try:
        try:
            tree = handler.metadata(epath.Path(path)).tree
        except (FileNotFoundError, ValueError) as e:
            raise FleetCheckpointError(
                f"fleet.load: {path} is not a checkpoint written by fleet.save ({e})"
            ) from None
        restore_args = jax.tree.map(_restore_args, tree)
        try:
            value = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                restore_args=restore_args))
        except Exception as e:  # noqa: BLE001 (tensorstore's errors on a damaged file)
            raise FleetCheckpointError(
                f"fleet.load: {path} is damaged: {str(e).splitlines()[0][:500]}"
            ) from None
    finally:
        checkpointer.close()
    _verify(path, value)
    return value


def _verify(path: str, value: Any) -> None:
    sums = _stored_sums(path)
    if sums is None:
        return
    arrays = _arrays(value)
    stored = {k: {_integrity.index_key((slice(None),) * np.ndim(arrays[k]), np.shape(arrays[k]))
                  if i is None else i: crc for i, crc in v.items()}
              for k, v in sums.items() if k in arrays}
    bad = _integrity.mismatches(stored, arrays, quote=False)
    if bad:
        raise FleetCheckpointError(
            f"fleet.load: {path} is damaged: {len(bad)} array{'s do' if len(bad) > 1 else ' does'} "
            f"not match the checksum written with {'them' if len(bad) > 1 else 'it'}:\n  "
            + "\n  ".join(bad)
        )
