"""Whether a failed save failed because the disk is full, or is read-only.

Decided from facts, never from an error's text: the ``errno`` of an ``OSError``
in the error's chain (``ENOSPC``, ``EDQUOT``: what fleet's own writes, and
orbax's Python-level file operations, raise), or else the state of the disk
after the failure. Tensorstore, which writes the arrays of a
``fleet.CheckpointManager`` step, reports a full disk only in its message's
text; for such an error the disk counts as full when its free space is less
than the step needs, plus a margin (:func:`lacks_space`). A directory that
cannot be written at all is told by the ``errno`` alone (:func:`unwritable`).
"""

from __future__ import annotations

import errno
import os
import shutil

#: Free space a save may need beyond its arrays (metadata, file system blocks),
#: at least; a twentieth of the arrays' size where that is more.
MARGIN = 16 * 2**20
_FULL = (errno.ENOSPC, errno.EDQUOT)
_UNWRITABLE = {errno.EROFS: "read-only",
               errno.EACCES: "not writable by this user (permission denied)",
               errno.EPERM: "not writable (operation not permitted)"}


def _errnos(e: BaseException | None) -> list[int]:
    """The ``errno`` s of the ``OSError`` s in ``e`` and its chain."""
    seen, out = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            out.append(e.errno)
        e = e.__cause__ or e.__context__
    return out


def errno_says_full(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception in its chain is an ``OSError`` for "no space
    left on device" or "disk quota exceeded"."""
    return any(n in _FULL for n in _errnos(e))


def unwritable(e: BaseException | None) -> str | None:
    """``"read-only"`` or ``"not writable ..."`` if ``e`` or an exception in its
    chain is an ``OSError`` for a read-only file system (``EROFS``) or a refused
    permission (``EACCES``, ``EPERM``); ``None`` otherwise."""
    return next((_UNWRITABLE[n] for n in _errnos(e) if n in _UNWRITABLE), None)


def nearest(path: str) -> str:
    """``path``, or its nearest parent that exists (what a failed write hit)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(directory: str) -> int | None:
    """Free space (for this user) on the disk of ``directory`` (or of its nearest
    existing parent); ``None`` if it cannot be asked."""
    try:
        return shutil.disk_usage(nearest(directory)).free
    except OSError:
        return None


def lacks_space(directory: str, needed: int) -> bool:
    """Whether the disk of ``directory`` has less free space than ``needed`` bytes
    plus :data:`MARGIN` (or a twentieth of ``needed``, if more)."""
    free = free_bytes(directory)
    return free is not None and free < needed + max(MARGIN, needed // 20)


def is_full(e: BaseException, directory: str, needed: int) -> bool:
    """Whether the save that raised ``e`` failed for a full disk: the ``errno``
    says so, or the disk of ``directory`` lacks the ``needed`` bytes now."""
    return errno_says_full(e) or lacks_space(directory, needed)


def describe(directory: str, needed: int) -> str:
    """``"1.9 MB free, the step needs 4.0 MB"``."""
    free = free_bytes(directory)
    have = "free space unknown" if free is None else f"{_mb(free)} free"
    return f"{have}, the step needs {_mb(needed)}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"
