"""The launcher side of liveness: is a worker stopped, silent, or waiting in a step
that a finished peer never ran?

Read from outside the worker, so that a frozen worker cannot hide:

* the process state in ``/proc/PID/stat``: ``T`` / ``t`` means stopped
  (``SIGSTOP``, ``Ctrl-Z``, a debugger). Works for any script.
* the heartbeat file (``FLEET_HEARTBEAT_FILE``, written by ``fleet._worker``):
  its modification time is the worker's last beat (every ``distributed_step``
  beats when it starts and when it returns), and it holds the worker's step
  counts and whether its script has ended well.

A job is stuck when, for ``timeout`` seconds (``--progress_timeout``), a worker
has been stopped, or silent since its last beat, or (before its first beat)
running with no beat at all. The time to the end of the first step gets
``max(timeout, first_step_min)`` (30 s by default: the worker imports, builds and
compiles then). The report
names the worker furthest behind: a stopped one first, then one that never sent
a heartbeat while others did, then the one whose
last heartbeat is oldest (in a deadlock every worker falls silent; the first to
do so is the likeliest cause). A worker that has finished (exited 0, or its
script ended well and it waits in JAX's shutdown barrier) is never blamed.

Uneven steps: when a worker has finished after N steps while a peer started step
N + 1 (or later) and has been silent since for ``min(timeout, uneven_grace)``
(10 s by default), the peer
waits in a collective the finished worker will never join. The job ends naming
the rank that ran more steps, and both step counts.
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


FIRST_STEP_MIN = 30.0  # seconds: the least time a worker gets before its first beat
UNEVEN_GRACE = 10.0  # seconds a worker may wait in a step that a finished peer never ran
# Both are launcher settings too (--first_step_min, --uneven_grace): tests set them to seconds.


def last_heartbeat(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


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


@dataclasses.dataclass(frozen=True)
class Watched:
    """A worker as the watchdog sees it.

    Attributes:
        started: the clock time it started (``None``: watched from its first beat on).
        finished: it exited with status 0.
    """

    rank: int
    pid: int
    heartbeat_file: str
    started: float | None = None
    finished: bool = False


@dataclasses.dataclass(frozen=True)
class Stuck:
    rank: int
    pid: int
    reason: str


class Watchdog:
    """Checks the workers; :meth:`check` returns the stuck one, if any.

    Args:
        timeout: ``--progress_timeout`` (0: never stuck).
        first_step_min: the least time before the first step ends.
        uneven_grace: the most time a worker waits in a step a finished peer never ran.
    """

    def __init__(self, timeout: float, clock=time.time, first_step_min: float = FIRST_STEP_MIN,
                 uneven_grace: float = UNEVEN_GRACE):
        self.timeout = timeout
        self.clock = clock
        self.first_step_min = first_step_min
        self._uneven_grace = uneven_grace
        self._stopped_since: dict[int, float] = {}
        self._finished_since: dict[int, float] = {}

    @property
    def first_step_timeout(self) -> float:
        return max(self.timeout, self.first_step_min)

    @property
    def uneven_grace(self) -> float:
        return min(self.timeout, self._uneven_grace)

    def check(self, workers: Iterable[Watched]) -> Stuck | None:
        if not self.timeout:
            return None
        now = self.clock()
        workers = list(workers)
        progress = {w.rank: read_progress(w.heartbeat_file) for w in workers}
        finished = {w.rank for w in workers if w.finished or progress[w.rank].done}
        for rank in finished:
            self._finished_since.setdefault(rank, now)
        running = [w for w in workers if w.rank not in finished]
        states = {w.rank: process_state(w.pid) for w in running}
        for w in running:
            if states[w.rank] in STOPPED_STATES:
                self._stopped_since.setdefault(w.rank, now)
            else:
                self._stopped_since.pop(w.rank, None)
        uneven = self._uneven(running, finished, progress, now)
        if uneven is not None:
            return uneven
        beats = {w.rank: progress[w.rank].beat for w in running}
        stopped_long = [w for w in running
                        if now - self._stopped_since.get(w.rank, now) >= self.timeout]
        silent = [w for w in running if (
            now - beats[w.rank] >= self._limit(progress[w.rank]) if beats[w.rank] is not None
            else w.started is not None and now - w.started >= self.first_step_timeout)]
        if not stopped_long and not silent:
            return None

        def behind(w: Watched) -> tuple:
            beat = beats[w.rank]
            return (w.rank not in self._stopped_since, beat is not None, beat or 0.0, w.rank)

        culprit = min(running, key=behind)
        return Stuck(rank=culprit.rank, pid=culprit.pid,
                     reason=self._reason(culprit, now, beats, progress, finished))

    def _limit(self, p: Progress) -> float:
        """Silence allowed after a beat: the first step (it compiles) gets the first
        step's allowance until it returns."""
        return self.first_step_timeout if p.ended == 0 else self.timeout

    def _uneven(self, running: list[Watched], finished: set[int],
                progress: dict[int, Progress], now: float) -> Stuck | None:
        counted = {r: progress[r].ended or 0 for r in finished}
        if not counted:
            return None
        fewest_rank = min(counted, key=lambda r: (counted[r], r))
        fewest = counted[fewest_rank]
        for w in running:
            p = progress[w.rank]
            if p.begun is None or p.begun <= fewest or w.rank in self._stopped_since:
                continue
            # Its last beat came when it started (or dispatched: JAX runs steps
            # asynchronously) a step the finished worker never ran; it has been silent since.
            waiting = now - max(p.beat or now, self._finished_since[fewest_rank])
            if waiting >= self.uneven_grace:
                return Stuck(rank=w.rank, pid=w.pid, reason=(
                    f"uneven steps: rank {w.rank} ran more steps ({p.begun}) than rank "
                    f"{fewest_rank} ({fewest}). Rank {fewest_rank} finished after {fewest} "
                    f"steps; rank {w.rank} started step {p.begun} and has waited {waiting:.1f} "
                    f"s since, in a collective rank {fewest_rank} never joins. Every process "
                    "must run the same number of steps: give each the same number of "
                    "batches (fleet.io.DistributedBatchSampler does)"))
        return None

    def _reason(self, w: Watched, now: float, beats: dict[int, float | None],
                progress: dict[int, Progress], finished: set[int]) -> str:
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
        others += "".join(f", rank {r}: finished" for r in sorted(finished))
        steps = _steps_text(progress, finished)
        if beats[w.rank] is None:
            if not any(b is not None for b in beats.values()):
                return (
                    f"no step started within {self.first_step_timeout:g} s of the start "
                    f"(the first step's limit: {limit}, at least {self.first_step_min:g} s) and no "
                    "worker sent a heartbeat: stuck before the first step, e.g. in a "
                    "collective call (barrier, checkpoint manager) that not every process "
                    "made"
                )
            return (
                f"it sent no heartbeat (no step started) while other workers did and then "
                f"went silent for {limit} (last heartbeats: {others}){steps}"
            )
        if self._limit(progress[w.rank]) != self.timeout:
            limit = f"the first step's limit, {self.first_step_timeout:g} s"
        return (
            f"no progress for {now - beats[w.rank]:.1f} s ({limit}): deadlocked, or "
            f"waiting on a peer that is gone; rank {w.rank} fell silent first (last "
            f"heartbeats: {others}){steps}"
        )


def _steps_text(progress: dict[int, Progress], finished: set[int]) -> str:
    counts = {r: p for r, p in progress.items() if p.begun is not None}
    if not counts:
        return ""
    parts = [f"rank {r}: {p.begun}" + (" (inside it)" if p.in_step else "")
             + (" (finished)" if r in finished else "") for r, p in sorted(counts.items())]
    return f"; steps started: {', '.join(parts)}"
