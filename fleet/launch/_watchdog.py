"""The launcher side of liveness: is a worker stopped, silent, or waiting in a step
that a finished peer never ran? (The rules as the user sees them: the manual,
``fleet/launch/_main.py``, "Failures".)

Read from outside the worker, so that a frozen worker cannot hide: the process
state in ``/proc/PID/stat`` (``T`` / ``t``: ``SIGSTOP``, ``Ctrl-Z``, a debugger;
works for any script), and the heartbeat file (``FLEET_HEARTBEAT_FILE``, format
and reader: ``fleet.runtime._heartbeat``), whose modification time is the
worker's last beat and which holds its step counts and whether its script has
ended well.

A job is stuck when, for ``timeout`` seconds, a worker has been stopped, or
silent since its last beat, or (before its first beat) running with no beat at
all; the first step gets ``max(timeout, first_step_min)``. The report names the
worker furthest behind: a stopped one first, then one that never sent a
heartbeat while others did, then the one whose last heartbeat is oldest (in a
deadlock every worker falls silent; the first to do so is the likeliest cause).
A finished worker (exited 0, or its script ended well and it waits in JAX's
shutdown barrier) is never blamed. Uneven steps: a worker finished after N steps
while a peer started step N + 1 (or later) and has been silent since for
``min(timeout, uneven_grace)``; the job ends naming the rank that ran more steps
and both step counts (:attr:`Stuck.brief`, for the job's last line). A silence
of ``silence_warning`` seconds, and each as many more, hands ``warn`` one line
naming the worker furthest behind, the other silent ranks, and the time until
``timeout`` ends the job.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from fleet.runtime._heartbeat import Progress, read_progress

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
SILENCE_WARNING = 60.0  # seconds of silence before the first warning line, and between lines
# All three are launcher settings too (--first_step_min, --uneven_grace, --silence_warning):
# tests set them to seconds.
_NAMED = 8  # at most this many other silent ranks are named in a warning line


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
    """The worker that ends the job: ``reason`` says why in full; ``brief``, when
    given, says it in a few words for the job's last line."""

    rank: int
    pid: int
    reason: str
    brief: str | None = None


class Watchdog:
    """Checks the workers; :meth:`check` returns the stuck one, if any.

    Args:
        timeout: ``--progress_timeout`` (0: never stuck).
        first_step_min: the least time before the first step ends.
        uneven_grace: the most time a worker waits in a step a finished peer never ran.
        silence_warning: the silence (seconds) that gets a warning line, and the time
            between the next ones while it lasts (0: no lines).
        warn: what receives each warning line (the launcher logs it).
    """

    def __init__(self, timeout: float, clock=time.time, first_step_min: float = FIRST_STEP_MIN,
                 uneven_grace: float = UNEVEN_GRACE, silence_warning: float = SILENCE_WARNING,
                 warn: Callable[[str], object] = lambda line: None):
        self.timeout = timeout
        self.clock = clock
        self.first_step_min = first_step_min
        self._uneven_grace = uneven_grace
        self.silence_warning = silence_warning
        self._warn = warn
        self._next_warning = silence_warning  # the silence that gets the next line
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
        since = {w.rank: beats[w.rank] or w.started for w in running}
        silent = [w for w in running if since[w.rank] is not None
                  and now - since[w.rank] >= self._limit(progress[w.rank])]
        if not stopped_long and not silent:
            self._warn_silence(running, progress, now)
            return None
        culprit = min(running, key=self._behind(beats))
        return Stuck(rank=culprit.rank, pid=culprit.pid,
                     reason=self._reason(culprit, now, beats, progress, finished))

    def _behind(self, beats: dict[int, float | None]) -> Callable[[Watched], tuple]:
        """The order of blame: a stopped worker first, then one with no beat, then the
        oldest beat."""
        def key(w: Watched) -> tuple:
            beat = beats[w.rank]
            return (w.rank not in self._stopped_since, beat is not None, beat or 0.0, w.rank)
        return key

    def _limit(self, p: Progress) -> float:
        """Silence allowed since the last beat (or the start): the first step (it
        compiles) gets the first step's allowance until it returns."""
        return self.first_step_timeout if p.beat is None or p.ended == 0 else self.timeout

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
                brief = (f"in its step {p.begun}, in a collective that rank {fewest_rank} "
                         f"never joins: rank {fewest_rank} ended after {fewest} steps "
                         "(uneven steps)")
                return Stuck(rank=w.rank, pid=w.pid, brief=brief, reason=(
                    f"uneven steps: rank {w.rank} ran more steps ({p.begun}) than rank "
                    f"{fewest_rank} ({fewest}). Rank {fewest_rank} finished after {fewest} "
                    f"steps; rank {w.rank} started step {p.begun} and has waited {waiting:.1f} "
                    f"s since, in a collective rank {fewest_rank} never joins. Every process "
                    "must run the same number of steps: give each the same number of "
                    "batches (fleet.io.DistributedBatchSampler does)"))
        return None

    def _warn_silence(self, running: list[Watched], progress: dict[int, Progress],
                      now: float) -> None:
        """A line when a worker has been silent ``silence_warning`` seconds, then one
        every ``silence_warning`` seconds while the longest silence lasts."""
        if not self.silence_warning:
            return
        since = {w.rank: progress[w.rank].beat or w.started for w in running}
        silent = [w for w in running if since[w.rank] is not None
                  and now - since[w.rank] >= self.silence_warning]
        if not silent:
            self._next_warning = self.silence_warning
            return
        longest = max(now - since[w.rank] for w in silent)
        if longest < self._next_warning:
            return
        self._next_warning = (longest // self.silence_warning + 1) * self.silence_warning
        w = min(silent, key=self._behind({r: p.beat for r, p in progress.items()}))
        p = progress[w.rank]
        what = (" (its process is stopped, state T: SIGSTOP, Ctrl-Z or a debugger)"
                if w.rank in self._stopped_since else
                " (no heartbeat since it started: still importing or compiling, or stuck)"
                if p.beat is None else
                " (in its first step, which compiles, or stuck)" if p.ended == 0 else
                f" (steps started: {p.begun}, ended: {p.ended})" if p.begun is not None else "")
        others = [f"rank {o.rank} ({now - since[o.rank]:.0f} s)" for o in silent if o is not w]
        if len(others) > _NAMED:
            others[_NAMED:] = [f"{len(others) - _NAMED} more"]
        left = max(0.0, min(self._time_left(o, progress[o.rank], since[o.rank], now)
                            for o in running))
        self._warn(
            f"rank {w.rank} (pid {w.pid}) has been silent for {now - since[w.rank]:.0f} s"
            f"{what}" + (f"; silent too: {', '.join(others)}" if others else "")
            + f"; --progress_timeout {self.timeout:g} s ends the job in {left:.0f} s unless "
            "a heartbeat comes"
        )

    def _time_left(self, w: Watched, p: Progress, since: float | None, now: float) -> float:
        """Seconds until ``w`` is stuck if nothing changes."""
        left = float("inf") if since is None else self._limit(p) - (now - since)
        if w.rank in self._stopped_since:
            left = min(left, self.timeout - (now - self._stopped_since[w.rank]))
        return left

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
