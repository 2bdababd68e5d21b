"""One writer a directory: the lock a :class:`fleet.CheckpointManager` holds on its
directory; and the same kind of lock on ``fleet.save``'s temporary files, so
that only those of dead writers are removed.

``directory/.fleet-lock`` names the writer, as JSON::

    {"host": "node3", "pid": 4242, "job": "job-1f2e" or null, "processes": 2,
     "since": "2026-11-24 15:45:03", "saving": 6 or null}

and the writer holds an exclusive ``flock`` on it for as long as its manager is
open. In a job of several processes the job is the writer: its process 0 holds
the lock (the others write the same steps through orbax, legitimately), and the
lock names the job. The kernel drops a ``flock`` when its process ends, however
it ends (``kill -9``, ``os._exit``), so whether the writer lives is asked of the
lock itself, never of a pid that may have been reused since: a file whose lock
can be taken but that still names a writer was left by a process that ended
without closing its manager. That lock is stale; the next manager takes it
over (:func:`take` returns the old holder, for a warning) when it names this
host.

A stale lock that names *another* host is refused (:class:`OtherHost`) unless the
caller allows it: a free ``flock`` proves the writer gone only where the file
system carries ``flock`` across hosts (a local disk seen by one host; NFSv4; Lustre
mounted with ``-o flock``; GPFS; CephFS). NFSv3 mounted with ``local_lock=flock``
or ``nolock``, and some FUSE file systems, keep each host's locks to itself: there
a live writer on another host leaves the lock free here, and taking it over would
make two writers of one directory. The user who knows that writer is gone (or
that the file system shares locks) says so (``FLEET_CHECKPOINT_TAKE_OVER``, read
by :mod:`fleet.checkpoint._open`). Closing the manager
empties the file and drops the lock; the file itself stays (deleting it would
let two writers lock two files of one name).

``saving`` is the step whose save this writer began last, written before
``save`` returns: a stale lock whose ``saving`` step is not complete tells the
next manager that this step was begun and never finished
(:mod:`fleet.checkpoint._open`).

Where the file system has no ``flock`` (``ENOLCK``, ``EOPNOTSUPP``), the pid
decides on the writer's own host (alive or not), and a writer on another host
is refused as above (:class:`OtherHost`) unless the caller allows it.

:func:`remove_if_abandoned` asks the same of any file: ``fleet.save`` holds a
lock on its temporary file while it writes (:func:`hold`), so that a later save
removes only the temporary files of writers that are gone.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable

NAME = ".fleet-lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


@dataclasses.dataclass(frozen=True)
class Holder:
    """The writer a lock file names."""

    host: str
    pid: int
    job: str | None = None
    processes: int = 1
    since: str = ""
    saving: int | None = None

    def __str__(self) -> str:
        more = [f"job {self.job}"] if self.job else []
        more += [f"process 0 of {self.processes}"] if self.processes > 1 else []
        more += [f"since {self.since}"] if self.since else []
        return f"pid {self.pid} on host {self.host}" + (f" ({', '.join(more)})" if more else "")

    @property
    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()


class _Refused(Exception):
    def __init__(self, holder: Holder | None):
        super().__init__(str(holder))
        self.holder = holder


class OtherHost(_Refused):
    """The directory's lock was left by a writer on another host (:attr:`holder`):
    this host cannot tell whether it still runs (see the module)."""


class Busy(_Refused):
    """The directory's lock is held by a live writer (:attr:`holder`; ``None``
    if it has not written its name yet)."""


def _read(fd: int) -> Holder | None:
    """The writer the open lock file names (``None``: empty or unreadable)."""
    try:
        doc = json.loads(os.pread(fd, 65536, 0).decode("utf-8") or "null")
        return None if doc is None else Holder(
            host=str(doc["host"]), pid=int(doc["pid"]), job=doc.get("job"),
            processes=int(doc.get("processes", 1)), since=str(doc.get("since", "")),
            saving=doc.get("saving") if isinstance(doc.get("saving"), int) else None)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def _alive(holder: Holder) -> bool:
    """Without ``flock``: whether ``holder``, a writer on this host, still runs."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _elsewhere(holder: Holder) -> bool:
    return holder.host != socket.gethostname()


def _flock(fd: int) -> bool:
    """Takes the exclusive lock on ``fd`` without waiting: ``True`` if taken,
    ``False`` if another process holds it (raises ``OSError``, an errno of
    :data:`_NO_FLOCK`, where the file system has no ``flock``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in _BUSY:
            return False
        raise


class DirectoryLock:
    """The lock of one manager's directory, held (:func:`take` makes one)."""

    def __init__(self, path: str, fd: int, holder: Holder):
        self.path, self._fd, self.holder = path, fd, holder

    def _write(self) -> None:
        data = json.dumps(dataclasses.asdict(self.holder)).encode()
        os.pwrite(self._fd, data, 0)  # (one write: whole, even if the process dies now)
        os.ftruncate(self._fd, len(data))

    def saving(self, step: int) -> None:
        """Records that the save of ``step`` begins (before ``save`` returns); best
        effort: a record that cannot be written leaves the save to say why it fails."""
        if self._fd >= 0:
            self.holder = dataclasses.replace(self.holder, saving=step)
            try:
                self._write()
            except OSError:
                pass

    def release(self) -> None:
        """Empties the file and drops the lock (the manager's ``close``, or its end)."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # (the lock still goes with the descriptor)
        finally:
            os.close(fd)


def take(directory: str, job: str | None, processes: int,
         other_host: Callable[[Holder], bool] | None = None,
         ) -> tuple[DirectoryLock, Holder | None]:
    """Locks ``directory`` (which exists) for this process, writing for ``job``;
    returns the lock and the writer of a stale lock it took over (``None`` if
    there was none). ``other_host(holder)``: whether a stale lock that names
    another host may be taken over (default: never).

    Raises:
        Busy: a live writer holds it (waits up to 2 s for a new writer's name).
        OtherHost: no live writer holds it as far as this host can tell, but it
            names a writer on another host, and ``other_host`` does not allow it.
        OSError: the file cannot be created or written (a read-only directory).
    """
    path = os.path.join(directory, NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            taken = _flock(fd)
            old = _read(fd)
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            old = _read(fd)
            taken = old is None or _elsewhere(old) or not _alive(old)
        if taken and old is not None and _elsewhere(old) and not (other_host
                                                                  and other_host(old)):
            raise OtherHost(old)
        if not taken:
            deadline = time.monotonic() + 2.0
            while old is None and time.monotonic() < deadline:  # (it has just taken it)
                time.sleep(0.05)
                old = _read(fd)
            raise Busy(old)
        me = Holder(host=socket.gethostname(), pid=os.getpid(), job=job, processes=processes,
                    since=time.strftime("%Y-%m-%d %H:%M:%S"))
        lock = DirectoryLock(path, fd, me)
        lock._write()
        return lock, old
    except BaseException:
        os.close(fd)
        raise


def remove_if_abandoned(path: str) -> bool:
    """Removes the file ``path`` if no live process holds a lock on it (its writer
    is gone), holding the lock while it does; returns whether it did. Where the
    file system has no locks, it never does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not _flock(fd):
            return False
        os.remove(path)  # (under the lock: a writer that locks it next finds it unlinked)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def hold(fd: int) -> bool:
    """Locks the file just created and opened as ``fd`` (a writer's temporary file)
    until it is closed. ``False`` if a process removing leftovers
    (:func:`remove_if_abandoned`) came first: it holds the lock, or has removed
    the file; the writer then makes another. Where the file system has no locks,
    ``True`` (nothing is removed there)."""
    try:
        if not _flock(fd):
            return False
    except OSError:
        return True
    return os.fstat(fd).st_nlink > 0
