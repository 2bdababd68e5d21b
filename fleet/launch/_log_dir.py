"""``fleetrun``'s ``--log_dir``: made, and written to once, before any worker starts.

Each worker's output goes to ``LOG_DIR/workerlog.RANK``. A directory that cannot
be made or written (a read-only file system, another user's directory) is told
before any start, as a :class:`fleet.FleetConfigError` naming the directory, what
the file system said (by its ``errno``: :func:`fleet.checkpoint._disk.unwritable`)
and what to give instead; ``fleetrun`` prints it and exits with code 2, like every
other bad option.

Whether the directory takes a file is asked by writing one (a temporary file,
removed at once): permission bits do not stop root, a read-only mount stops
everyone, and only the write itself tells both apart.
"""

from __future__ import annotations

import os
import tempfile

from fleet._errors import FleetConfigError
from fleet.checkpoint import _disk


def make_log_dir(log_dir: str) -> None:
    """Creates ``log_dir`` (and its parents) and checks that a file can be written
    there.

    Raises:
        fleet.FleetConfigError: it cannot be made or written; the message names
            the directory (or the parent that refused), why, and what to do.
    """
    try:
        os.makedirs(log_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fleetrun-write-test-", dir=log_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _unwritable(log_dir, e) from None


def _unwritable(log_dir: str, e: OSError) -> FleetConfigError:
    hit = _disk.nearest(log_dir)
    where = hit if hit == os.path.abspath(log_dir) else f"{hit} (to create {log_dir})"
    why = _disk.unwritable(e)
    said = f"it is {why}" if why is not None else "it cannot be written"
    return FleetConfigError(
        f"--log_dir {log_dir!r}: cannot write to {where}: {said} ([Errno {e.errno}] {e.strerror}). "
        "fleetrun writes each worker's output there (workerlog.RANK) before it starts "
        "them: give a writable directory with --log_dir DIR (or FLEETRUN_LOG_DIR=DIR), "
        "or remount the file system writable"
    )
