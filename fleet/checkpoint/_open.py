"""Opening a manager's directory: created, writable, locked for one writer, and
what an earlier writer left unfinished said aloud.

:func:`open_directory` runs in ``CheckpointManager(...)`` before orbax touches the
directory (orbax's start removes the partial steps of an earlier writer, which
must not be those of a live one). On process 0 of the job it

1. creates the directory; a read-only one (or one this user may not write) is a
   :class:`FleetCheckpointError` naming the path, decided by the ``errno``
   (:func:`fleet.checkpoint._disk.unwritable`);
2. takes the directory's lock (:mod:`fleet.checkpoint._lock`): a directory that
   another live job writes is refused, naming that job's host and pid; a
   stale lock (its writer ended without closing its manager: killed,
   ``os._exit``) is taken over with a :class:`fleet.FleetWarning` naming the dead
   pid and host; one that names another host only with :data:`TAKE_OVER`;
3. finds the steps whose save began and never finished: a partial
   ``<step>.orbax-checkpoint-tmp-*`` directory, or the step a stale lock says its
   writer was saving (an asynchronous save cut off before anything reached the
   disk). The warning names them, so that a step is never silently missing
   from the list, and their partial files are removed (orbax would remove
   them too, but in the background, after the manager is made).

The other processes take process 0's outcome (:func:`fleet.runtime._agree.agree`): every
process raises the same error, or warns the same warnings.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import warnings

import jax

from fleet._errors import FleetWarning
from fleet.checkpoint import _disk, _lock, _pending
from fleet.checkpoint._errors import FleetCheckpointError, first_line
from fleet.runtime import _agree, _world

#: What a manager does to its directory before orbax touches it, and what that asks.
_DOING = {"create": "give a directory this process can create and write",
          "lock": f"a checkpoint manager writes its lock file {_lock.NAME} there"}


def _cannot(directory: str, doing: str, e: OSError) -> FleetCheckpointError:
    """The error for an ``OSError`` while ``doing`` (a key of :data:`_DOING`) to
    ``directory``: a read-only or not writable one is named so (by the ``errno``)."""
    why = _disk.unwritable(e)
    if why is None:
        return FleetCheckpointError(
            f"CheckpointManager: cannot {doing} {directory} ({first_line(e)}); {_DOING[doing]}")
    hit = _disk.nearest(directory)
    where = hit if hit == directory else f"{hit} (to create {directory})"
    return FleetCheckpointError(
        f"CheckpointManager: cannot write to {where}: it is {why} ({first_line(e)}). A "
        f"checkpoint manager writes its steps and its lock file ({_lock.NAME}) there: give "
        "a writable directory (or remount it writable). To read a step of a read-only "
        f"directory, fleet.load reads each of its parts: fleet.load('{directory}/<step>/model')"
    )


#: Set to ``1``, or to the host a stale lock names, to take over a lock that a
#: writer on another host left (see the module).
TAKE_OVER = "FLEET_CHECKPOINT_TAKE_OVER"


def _other_host(directory: str, holder: _lock.Holder) -> FleetCheckpointError:
    lock_file = os.path.join(directory, _lock.NAME)
    return FleetCheckpointError(
        f"CheckpointManager: {directory} is locked by {holder}, another host than this "
        f"one ({socket.gethostname()}), which ended without closing its manager or still "
        f"runs: this host cannot tell. No process here holds the lock file {lock_file}, "
        "but a file system that keeps each host's flock to itself (NFSv3 mounted with "
        "local_lock=flock or nolock, some FUSE file systems) or has none shows a live "
        f"writer's lock as free. If pid {holder.pid} no longer runs on {holder.host} "
        f"(ssh {holder.host} ps -p {holder.pid}), take the directory over: set "
        f"{TAKE_OVER}={holder.host} (or {TAKE_OVER}=1 for any host) in this job's "
        "environment, or delete the lock file; else give this job another directory"
    )


def _allows_other_host(holder: _lock.Holder) -> bool:
    """Whether :data:`TAKE_OVER` lets this job take over ``holder``'s stale lock."""
    value = os.environ.get(TAKE_OVER, "").strip()
    return value in ("1", holder.host)


def _busy(directory: str, holder: _lock.Holder | None) -> FleetCheckpointError:
    if holder is not None and holder.is_this_process:
        return FleetCheckpointError(
            f"CheckpointManager: {directory} is already open in another CheckpointManager "
            f"of this process ({holder}); a checkpoint directory has one writer at a time: "
            "close the other manager first (manager.close(), or `with CheckpointManager(...)`)"
        )
    who = "a process that has not written its name yet" if holder is None else str(holder)
    return FleetCheckpointError(
        f"CheckpointManager: {directory} is being written by another job ({who}); a "
        "checkpoint directory has one writer at a time: wait until that job ends, or give "
        "this job another directory"
    )


def _unfinished(directory: str, stale: _lock.Holder | None) -> tuple[list[int], int | None]:
    """The steps begun and never finished in ``directory``, and its newest complete step."""
    complete, partial = set(), set()
    for name in os.listdir(directory):
        head = name.split(".", 1)[0]
        if name.isdigit() and os.path.isdir(os.path.join(directory, name)):
            complete.add(int(name))
        elif head.isdigit() and name[len(head):].startswith(_pending.PARTIAL):
            partial.add(int(head))
    if stale is not None and stale.saving is not None:
        partial.add(stale.saving)
    return sorted(partial - complete), max(complete, default=None)


def _warnings(directory: str, stale: _lock.Holder | None) -> list[str]:
    """What to say about what the previous writer left (nothing if all is well);
    removes the partial steps (before orbax would, in the background)."""
    partial, newest = _unfinished(directory, stale)
    for step in partial:
        _pending.remove_partial(directory, step)
    steps = ", ".join(map(str, partial))
    lost = (f"the save of step{'s' if len(partial) > 1 else ''} {steps} was begun and never "
            f"finished: {'they are' if len(partial) > 1 else 'it is'} not listed (the newest "
            f"complete step is {newest}; partial files are removed)") if partial else ""
    if stale is not None:
        return [f"CheckpointManager: {directory} was left locked by {stale}, which ended "
                "without closing its CheckpointManager (killed, or os._exit); this process "
                f"takes the directory over{'; ' + lost if lost else ''}"]
    if lost:
        return [f"CheckpointManager: in {directory}, {lost}; its writer ended while saving"]
    return []


def _take(directory: str) -> tuple[_lock.DirectoryLock, _lock.Holder | None]:
    """:func:`fleet.checkpoint._lock.take` for this job. A manager this process
    dropped without ``close()`` holds the lock until it is collected (it is part
    of a reference cycle): it is collected before this process is refused."""
    job = _world.world().env.job_id if _world.is_initialized() else None
    try:
        return _lock.take(directory, job, jax.process_count(), _allows_other_host)
    except _lock.Busy as e:
        if e.holder is None or not e.holder.is_this_process:
            raise
    gc.collect()  # (a dropped manager's finalizer releases its lock)
    return _lock.take(directory, job, jax.process_count(), _allows_other_host)


def _open_here(directory: str) -> tuple[_lock.DirectoryLock | None, str, list[str]]:
    """Process 0's part: ``(lock, error, warnings)``, the error ``""`` if none."""
    doing = "create"
    try:
        os.makedirs(directory, exist_ok=True)
        doing = "lock"
        lock, stale = _take(directory)
    except _lock.Busy as e:
        return None, str(_busy(directory, e.holder)), []
    except _lock.OtherHost as e:
        return None, str(_other_host(directory, e.holder)), []
    except OSError as e:
        return None, str(_cannot(directory, doing, e)), []
    try:
        return lock, "", _warnings(directory, stale)
    except OSError as e:
        lock.release()
        return None, f"CheckpointManager: cannot list {directory} ({first_line(e)})", []


def open_directory(directory: str) -> _lock.DirectoryLock | None:
    """Makes ``directory`` this job's to write (collective; see the module): the
    lock, on process 0 (``None`` on the others).

    Raises:
        FleetCheckpointError: it cannot be written (read-only, not writable), or
            another live job writes it (named by host and pid).
    """
    lock, error, said = _open_here(directory) if jax.process_index() == 0 else (None, "", [])
    if jax.process_count() > 1:  # (every process takes process 0's outcome)
        error, said = json.loads(_agree.agree("fleet.CheckpointManager(directory)",
                                              json.dumps([error, said]))[0])
        if error:
            _agree.raise_together("fleet.CheckpointManager(directory)")
    if error:
        raise FleetCheckpointError(error)
    for text in said:
        warnings.warn(text, FleetWarning, stacklevel=3)
    return lock
