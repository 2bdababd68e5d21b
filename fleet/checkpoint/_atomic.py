"""``fleet.save``'s atomic write: a temporary file beside the target, put in place
in one rename, and the temporary files of killed writers removed.

:func:`write` writes the file under a temporary name in the target's directory,
``.NAME.fleet-new-<rank>-<pid>-<random>``, flushes it to disk, and renames it
onto ``NAME`` in one ``os.replace``: a crash at any moment leaves either the old
or the new checkpoint at ``NAME``, never a mixture. Several processes may write
one path at once; each has its own temporary file, and the last rename stays.

The writer holds a lock (``flock``, :func:`fleet.checkpoint._lock.hold`) on its
temporary file until the file is in place. A writer killed while writing
(``kill -9``) leaves its temporary file behind, and the kernel drops its lock:
the next save to ``NAME`` removes every ``.NAME.fleet-new-*`` whose lock it can
take (:func:`remove_leftovers`), and never one a live writer holds. (A writer
locks its file right after creating it; should a concurrent save take the file
for a leftover in that instant, the writer finds it taken or gone and makes
another.)

Errors, decided by ``errno`` (:mod:`fleet.checkpoint._disk`): a full disk and a
directory that cannot be written (read-only, permission denied) are
:class:`FleetCheckpointError` s naming the directory; the previous checkpoint at
``NAME`` is left as it was.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid

import jax

from fleet.checkpoint import _disk, _file, _lock
from fleet.checkpoint._errors import FleetCheckpointError, first_line

_NEW = "fleet-new"  # the temporary file: .NAME.fleet-new-<tag>
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Swaps what is at ``a`` and ``b`` atomically (Linux ``renameat2``); ``False``
    where the system cannot."""
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


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _put_in_place(fresh: str, final: str, tag: str) -> None:
    """Moves the complete file ``fresh`` to ``final``, replacing what is there (a
    file, or the directory of an earlier fleet.save); ``final`` always holds a
    complete checkpoint, even with several processes saving to it at once."""
    while True:
        try:
            os.replace(fresh, final)  # over a file, or nothing
            return
        except IsADirectoryError:
            pass
        if _exchange(fresh, final):  # fresh now holds the directory
            _remove(fresh)
            return
        old = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.fleet-old-{tag}")
        try:
            os.rename(final, old)
        except FileNotFoundError:
            continue  # another process moved it away: try again
        try:
            os.replace(fresh, final)
        finally:
            _remove(old)
        return


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(final: str) -> list[str]:
    """Removes the temporary files that writers of ``final`` left when they were
    killed (those whose lock can be taken); returns their paths."""
    parent, name = os.path.split(final)
    prefix = f".{name}.{_NEW}-"
    try:
        entries = [e for e in os.listdir(parent) if e.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for entry in entries:
        path = os.path.join(parent, entry)
        # (a directory there is an old checkpoint a writer is swapping out, or the
        # temporary directory of a fleet.save before it wrote files: never live data)
        if os.path.isdir(path) and not os.path.islink(path):
            _remove(path)
            removed.append(path)
        elif _lock.remove_if_abandoned(path):
            removed.append(path)
    return removed


def _refused(final: str, parent: str, e: BaseException) -> FleetCheckpointError | None:
    """The error for a write that failed because the disk is full or cannot be
    written (``None``: another failure, raised as it is)."""
    if _disk.errno_says_full(e):
        return FleetCheckpointError(
            f"fleet.save: disk full at {parent}: {final} was not written "
            f"({'the previous one is unchanged' if os.path.exists(final) else 'nothing is there'}); "
            "free space and save again")
    why = _disk.unwritable(e)
    if why is not None:
        hit = _disk.nearest(parent)
        where = hit if hit == parent else f"{hit} (to create {parent})"
        return FleetCheckpointError(
            f"fleet.save: cannot write {final}: {where} is {why} ({first_line(e)}); nothing "
            "was written: save to a writable directory")
    return None


def _fresh(parent: str, name: str) -> tuple[str, str, int]:
    """``(path, tag, descriptor)`` of a new temporary file for ``name``, locked
    until the descriptor is closed (another save's :func:`remove_leftovers`
    leaves it alone)."""
    for _ in range(100):
        tag = f"{jax.process_index()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fresh = os.path.join(parent, f".{name}.{_NEW}-{tag}")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        if _lock.hold(fd):
            return fresh, tag, fd
        os.close(fd)  # (a concurrent save removes it as a leftover: take another name)
    return fresh, tag, os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)


def write(final: str, tree: _file.Tree | bytes) -> None:
    """Writes ``tree`` (:func:`fleet.checkpoint._file.encode`), or raw ``bytes``
    (``Model.save(training=False)``'s exported program), to the file ``final``
    atomically, creating its directory (see the module).

    Raises:
        FleetCheckpointError: the disk is full, or the directory cannot be written.
    """
    parent, name = os.path.split(final)
    fresh, tag, guard = "", "", -1
    try:
        os.makedirs(parent, exist_ok=True)
        remove_leftovers(final)
        fresh, tag, guard = _fresh(parent, name)
        with open(fresh, "wb") as f:
            if isinstance(tree, bytes):
                f.write(tree)
            else:
                _file.write(f, tree)
            f.flush()
            os.fsync(f.fileno())
        _put_in_place(fresh, final, tag)
        _sync_directory(parent)
    except BaseException as e:
        if guard >= 0:
            _remove(fresh)
        refused = _refused(final, parent, e)
        if refused is None:
            raise
        raise refused from None
    finally:
        if guard >= 0:
            os.close(guard)
