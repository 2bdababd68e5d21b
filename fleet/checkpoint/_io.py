"""``fleet.save`` / ``fleet.load``: Paddle's ``paddle.save`` / ``paddle.load`` for state dicts.

``fleet.save(model.state_dict(), "model.pdparams")`` writes an orbax PyTree
checkpoint, a directory, from the calling process alone (no collective): in a
multi-process job call it on one process (``if fleet.is_first_worker():``) or
give each process its own path. ``fleet.load`` returns the same nesting with
numpy arrays; it reads arrays and JSON only and never unpickles.

The write is atomic: orbax writes a temporary directory and renames it; an
existing ``path`` is replaced only once the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from fleet.checkpoint import _tree
from fleet.checkpoint._errors import FleetCheckpointError

_LEAVES = "arrays, numpy or Python numbers, strings"


def _local_checkpointer() -> tuple[ocp.Checkpointer, ocp.PyTreeCheckpointHandler]:
    """An orbax checkpointer (and its handler) that runs on this process alone,
    with no barrier with the other processes."""
    me = jax.process_index()
    local = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=local)
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


def save(obj: Any, path: str | os.PathLike) -> None:
    """Writes ``obj`` (a state dict) to the directory ``path``, replacing it if present.

    Args:
        obj: nested dicts / lists of arrays (jax or numpy), numbers and strings,
            such as ``model.state_dict()``. Replicated ``jax.Array`` s are written
            once, from this process's first copy; PRNG keys as their key data.
        path: a directory (created; Paddle's ``"model.pdparams"`` names work).

    Example:
        >>> fleet.save(model.state_dict(), "model.pdparams")  # doctest: +SKIP
        >>> model.set_state_dict(fleet.load("model.pdparams"))
    """
    tree = jax.tree_util.tree_map_with_path(_host_leaf, obj)
    final = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    fresh = os.path.join(parent, f".{name}.fleet-new-{tag}")
    checkpointer, _ = _local_checkpointer()
    try:
        checkpointer.save(fresh, args=ocp.args.PyTreeSave(tree))
    finally:
        checkpointer.close()
    if not os.path.exists(final):
        os.rename(fresh, final)
        return
    old = os.path.join(parent, f".{name}.fleet-old-{tag}")
    os.rename(final, old)
    os.rename(fresh, final)
    shutil.rmtree(old, ignore_errors=True)


def _restore_args(m: Any) -> ocp.RestoreArgs:
    arrays = isinstance(m, ocp.metadata.ArrayMetadata) and not isinstance(
        m, ocp.metadata.ScalarMetadata)
    return ocp.RestoreArgs(restore_type=np.ndarray if arrays else None)


def load(path: str | os.PathLike) -> Any:
    """Reads what :func:`save` wrote: the same nesting, arrays as numpy.

    Loading reads arrays (tensorstore) and JSON only; nothing in the files is
    executed. Also reads one part of a :class:`fleet.CheckpointManager` step, e.g.
    ``fleet.load("ckpt/100/model")`` is the model's state dict.

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
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    finally:
        checkpointer.close()
