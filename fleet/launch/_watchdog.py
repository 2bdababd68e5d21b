"""The launcher side of liveness: is a worker stopped, or silent for too long?

Two signals, both read from outside the worker so that a frozen worker cannot
hide:

* the process state in ``/proc/PID/stat``: ``T`` / ``t`` means stopped
  (``SIGSTOP``, ``Ctrl-Z``, a debugger). Works for any script.
* the heartbeat file's modification time (see ``fleet.launch.heartbeat``), touched
  by every ``distributed_step``. A worker is watched this way from its first
  heartbeat on, so a script that never sends one is never called silent.

When a worker has been stopped, or silent, for ``timeout`` seconds, the job is
stuck. The report names the worker furthest behind: a stopped one first, then
one that never sent a heartbeat while others did, then the one whose last
heartbeat is oldest (in a deadlock every worker falls silent; the first to do so
is the likeliest cause).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable

STOPPED_STATES = frozenset("Tt")


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ``Z``...), ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses; state follows the last ")".
    rest = stat[stat.rfind(")") + 1:].split()
    return rest[0] if rest else None


def last_heartbeat(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class Watched:
    rank: int
    pid: int
    heartbeat_file: str


@dataclasses.dataclass(frozen=True)
class Stuck:
    rank: int
    pid: int
    reason: str


class Watchdog:
    """Checks running workers; :meth:`check` returns the stuck one, if any."""

    def __init__(self, timeout: float, clock=time.time):
        self.timeout = timeout
        self.clock = clock
        self._stopped_since: dict[int, float] = {}

    def check(self, workers: Iterable[Watched]) -> Stuck | None:
        if not self.timeout:
            return None
        now = self.clock()
        workers = list(workers)
        states = {w.rank: process_state(w.pid) for w in workers}
        for w in workers:
            if states[w.rank] in STOPPED_STATES:
                self._stopped_since.setdefault(w.rank, now)
            else:
                self._stopped_since.pop(w.rank, None)
        beats = {w.rank: last_heartbeat(w.heartbeat_file) for w in workers}
        stopped_long = [w for w in workers
                        if now - self._stopped_since.get(w.rank, now) >= self.timeout]
        silent = [w for w in workers
                  if beats[w.rank] is not None and now - beats[w.rank] >= self.timeout]
        if not stopped_long and not silent:
            return None

        def behind(w: Watched) -> tuple:
            beat = beats[w.rank]
            return (w.rank not in self._stopped_since, beat is not None, beat or 0.0, w.rank)

        culprit = min(workers, key=behind)
        return Stuck(rank=culprit.rank, pid=culprit.pid, reason=self._reason(culprit, now, beats))

    def _reason(self, w: Watched, now: float, beats: dict[int, float | None]) -> str:
        limit = f"--progress_timeout {self.timeout:g} s"
        if w.rank in self._stopped_since:
            return (
                f"its process has been stopped (state T: SIGSTOP, Ctrl-Z or a debugger) for "
                f"{now - self._stopped_since[w.rank]:.1f} s ({limit})"
            )
        others = ", ".join(
            f"rank {r}: {'none' if b is None else f'{now - b:.2f} s ago'}"
            for r, b in sorted(beats.items())
        )
        if beats[w.rank] is None:
            return (
                f"it sent no heartbeat (no step finished) while other workers did and then "
                f"went silent for {limit} (last heartbeats: {others})"
            )
        return (
            f"no progress for {now - beats[w.rank]:.1f} s ({limit}): deadlocked, or "
            f"waiting on a peer that is gone; rank {w.rank} fell silent first (last "
            f"heartbeats: {others})"
        )
