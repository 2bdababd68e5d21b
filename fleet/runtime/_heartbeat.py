"""The heartbeat file: the one home of its format, written by a worker, read by its launcher.

The launcher gives every worker a file (:data:`ENV`, ``FLEET_HEARTBEAT_FILE``,
named by :func:`file_for`). The worker's side: :func:`heartbeat` touches it,
``fleet.distributed_step`` counts its steps in it (:func:`step_begin`,
:func:`step_end`), and the end of the script is written in it
(:func:`mark_finished`, :func:`mark_failed`). The launcher's side
(``fleet.launch._watchdog``): :func:`read_progress` reads it back as a
:class:`Progress`. ``fleet.launch.heartbeat`` is :func:`heartbeat`, re-exported.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

ENV = "FLEET_HEARTBEAT_FILE"


def file_for(directory: str, rank: int) -> str:
    """The heartbeat file of worker ``rank`` in the launcher's ``directory``."""
    return os.path.join(directory, f"heartbeat.{rank}")


def heartbeat() -> None:
    """Tells the launcher this worker is making progress (cheap; call it every step).

    The launcher gives every worker a file, ``FLEET_HEARTBEAT_FILE``; this touches
    it (one ``utime`` system call, a few microseconds). ``fleet.distributed_step``
    beats when a step starts and when it returns; a script with its own loop can
    call it too. The launcher's watchdog expects the first beat within
    ``--progress_timeout`` seconds of the worker's start (30 s at least) and each
    next one within ``--progress_timeout`` seconds, so a worker that deadlocks, or
    waits forever on a dead peer, ends the job instead of hanging it. Outside a
    launcher it does nothing.

    Example:
        >>> from fleet.launch import heartbeat
        >>> for step in range(3):
        ...     heartbeat()   # no-op when not started by fleetrun / fleet.spawn
    """
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            with open(path, "a"):
                pass
        except OSError:
            pass
    except OSError:
        pass


# The heartbeat file also holds the worker's step counts, so that the launcher can
# tell processes that ran different numbers of steps (one waits in a step its peer
# never runs) from a deadlock: ``BEGUN ENDED STATE`` (STATE: ``run`` or ``done``,
# written when the script ended with exit status 0), padded to a fixed width and
# rewritten in place with one ``pwrite`` (which also updates the time of the beat).
#
# A step call only counts: the counts are written when the last write is older than
# BEAT_INTERVAL, else by a daemon thread (started with the first write) within
# BEAT_INTERVAL, so a worker that blocks right after a step (on a dead peer, in
# its next host read) still leaves its true counts. The file's time (the beat the
# watchdog reads) is set to when the counts last changed, not when they were
# written, so the watchdog still tells which worker fell silent first. A step
# that runs for hours writes nothing meanwhile, as before.
PROGRESS_WIDTH = 48
BEAT_INTERVAL = 0.2  # seconds
_progress = {"fd": None, "begun": 0, "ended": 0, "path": None, "at": float("-inf"),
             "written": None, "state": "run", "flusher": None, "changed": None,
             "failed_at": None}
_lock = threading.Lock()


def _write_progress(state: str = "run") -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with _lock:
        if state == "run" and _progress["state"] != "run":
            return  # done or failed: never overwritten by a later count
        _progress["state"] = state
        counts = (_progress["begun"], _progress["ended"])
        try:
            if _progress["fd"] is None or _progress["path"] != path:
                _progress["fd"] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                _progress["path"] = path
            line = f"{counts[0]} {counts[1]} {state}"
            os.pwrite(_progress["fd"], line.ljust(PROGRESS_WIDTH).encode() + b"\n", 0)
            changed = _progress["changed"]  # (time.monotonic(): one clock read a step)
            if state == "run" and changed is not None and os.utime in os.supports_fd:
                # the beat: when the counts changed
                at = time.time() - (time.monotonic() - changed)
                os.utime(_progress["fd"], (at, at))
        except OSError:
            pass
        _progress["at"], _progress["written"] = time.monotonic(), counts
        if _progress["flusher"] is None and state == "run":
            _progress["flusher"] = threading.Thread(target=_flush, name="fleet-heartbeat",
                                                    daemon=True)
            _progress["flusher"].start()


def _flush() -> None:
    """The daemon thread: writes counts a step left unwritten (see above)."""
    while _progress["state"] == "run":
        time.sleep(BEAT_INTERVAL)
        if (_progress["begun"], _progress["ended"]) != _progress["written"]:
            _write_progress()


def _forked_child() -> None:
    global _lock
    _lock = threading.Lock()  # (the parent's may have been held)
    _progress.update(fd=None, path=None, flusher=None, written=None, at=float("-inf"))


os.register_at_fork(after_in_child=_forked_child)


def _beat() -> None:
    now = _progress["changed"] = time.monotonic()
    if now - _progress["at"] >= BEAT_INTERVAL:
        _progress["at"] = now  # (also without a heartbeat file: no lookup at every step)
        _write_progress()


def step_begin() -> None:
    """Called by ``fleet.distributed_step`` when a step starts (before any collective):
    counts the step and beats."""
    _progress["begun"] += 1
    _beat()


def step_end() -> None:
    """Called by ``fleet.distributed_step`` when a step has returned: counts and beats."""
    _progress["ended"] += 1
    _beat()


def steps() -> tuple[int, int]:
    """``(begun, ended)``: the steps this process started and finished so far."""
    return _progress["begun"], _progress["ended"]


def mark_finished() -> None:
    """Tells the launcher this worker's program ended well (exit status 0), before it
    waits for its peers in JAX's shutdown barrier; the watchdog never blames it."""
    _write_progress("done")


def mark_failed() -> None:
    """Writes ``failed:<time>`` in this worker's heartbeat file (once)."""
    if _progress["failed_at"] is None:
        _progress["failed_at"] = time.time()
        _write_progress(f"failed:{_progress['failed_at']:.6f}")


# -- the launcher's side ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Progress:
    """What a heartbeat file says: the last beat, step counts, whether the script ended."""

    beat: float | None = None
    begun: int | None = None
    ended: int | None = None
    done: bool = False
    failed_at: float | None = None  # when the worker's script failed, by its own word

    @property
    def in_step(self) -> bool:
        return self.begun is not None and self.ended is not None and self.begun > self.ended


def read_progress(path: str) -> Progress:
    try:
        with open(path, "rb") as f:
            beat = os.fstat(f.fileno()).st_mtime
            text = f.read(256).decode("ascii", "replace")
    except OSError:
        return Progress()
    parts = text.split()
    if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
        failed_at = None
        if parts[2].startswith("failed:"):
            try:
                failed_at = float(parts[2][len("failed:"):])
            except ValueError:
                pass
        return Progress(beat, int(parts[0]), int(parts[1]), parts[2] == "done", failed_at)
    return Progress(beat)  # touched by heartbeat() alone
