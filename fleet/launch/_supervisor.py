"""The one supervisor of ``fleetrun`` and ``fleet.spawn``: watch the workers, name
the first failure, stop the rest.

Both launchers start their workers their own way (``fleet/launch/_agent.py``,
``fleet/launch/_spawn.py``) and hand them here as :class:`Worker` adapters, which
say only how to wait for a worker's end (and what error text it sent). One thread
per worker waits for its exit and posts it on a queue, so the supervisor learns
the order in which workers died; :meth:`Supervisor.run` waits for those exits,
for a signal and for a deadline, and every ``_CHECK_EVERY`` seconds asks the
watchdog (``fleet/launch/_watchdog.py``) for a stuck worker.

Stopping: each worker runs in a session (and process group) of its own and gets
``SIGKILL`` from the kernel if its launcher dies, even by ``SIGKILL``
(:func:`die_with_parent`). :meth:`Supervisor.stop` sends ``SIGTERM`` (and
``SIGCONT``, for stopped workers) to every worker's process group and to the
worker itself (a ``fleet.spawn`` child may not have made its group yet), then
``SIGKILL`` to every group after a short grace, or at once when the caller says
to hurry (a second Ctrl-C): JAX workers take ``SIGTERM`` as a preemption notice
and keep running, so the ``SIGKILL`` is what ends them. Leftover children of a
worker die with its group.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from fleet.launch._config import LaunchConfig
from fleet.launch._failure import Failure
from fleet.launch._watchdog import (
    STOPPED_STATES,
    Stuck,
    Watchdog,
    Watched,
    process_state,
)
from fleet.launch._worker_plan import WorkerSpec
from fleet.runtime import _heartbeat
from fleet.runtime._heartbeat import read_progress

_log = logging.getLogger("fleet.launch")  # the watchdog's warning lines (a silent worker)
_POLL = 0.1  # seconds between looks at signals and at the caller's tick (log echo)
_CHECK_EVERY = 0.5  # seconds between watchdog checks
# After the first failure, how long other exits may still arrive before the culprit is
# named: a worker killed by a signal makes its peers fail in their next collective, and
# their exits may reach the launcher first.
_SETTLE = 0.5
TERMINATE_GRACE = 3.0  # seconds between SIGTERM and SIGKILL
_PR_SET_PDEATHSIG = 1


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int) -> None:
    """In a child: ask the kernel for ``SIGKILL`` when the parent dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before we asked
        os._exit(1)


class Worker:
    """A started worker as the supervisor sees it.

    An adapter implements :meth:`_wait_for_exit` and may set :attr:`error` (the
    error text the worker sent) and :attr:`log_path` / :attr:`log_offset` (where
    this attempt's output is).
    """

    def __init__(self, spec: WorkerSpec, pid: int):
        self.spec, self.pid = spec, pid
        self.started = time.time()
        self.returncode: int | None = None  # negative: killed by that signal
        self.error: str | None = None
        self.log_path: str | None = None
        self.log_offset = 0
        self.exited = threading.Event()  # set once the process has ended and been reaped

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def failed(self) -> bool:
        """It exited non-zero, died of a signal, or sent an error."""
        return self.returncode != 0 or self.error is not None

    def send_signal(self, signum: int) -> None:
        """``signum`` to the worker's process group, and to the worker while it lives."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)
        if not self.exited.is_set():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def _wait_for_exit(self) -> int:
        """Blocks until the process has ended and is reaped; its returncode."""
        raise NotImplementedError

    def _watch_exit(self, events: queue.Queue[Worker]) -> None:
        """The body of the worker's waiter thread: the only place that reaps it."""
        self.returncode = self._wait_for_exit()
        self.exited.set()
        events.put(self)

    def watched(self) -> Watched:
        return Watched(self.rank, self.pid, self.spec.environ[_heartbeat.ENV],
                       started=self.started,
                       finished=self.exited.is_set() and self.returncode == 0)

    def failure(self, stuck: Stuck | None = None) -> Failure:
        return Failure(rank=self.rank, pid=self.pid,
                       returncode=None if stuck is not None else self.returncode,
                       stuck=None if stuck is None else stuck.reason,
                       stuck_brief=None if stuck is None else stuck.brief, error=self.error,
                       log_path=self.log_path, log_offset=self.log_offset)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How :meth:`Supervisor.run` ended: every worker finished (neither field), one
    failed (``failure``), or the launcher got a signal (``signum``)."""

    failure: Failure | None = None
    signum: int | None = None


class Supervisor:
    """One group of workers, started together and stopped together.

    Use: ``with supervisor.starting() as add:`` start each worker and ``add`` it;
    then :meth:`run` until it returns an :class:`Outcome`; then :meth:`stop` (or
    :meth:`reap` when every worker finished).
    """

    def __init__(self, config: LaunchConfig):
        self.workers: list[Worker] = []
        self._watchdog = Watchdog(config.progress_timeout, first_step_min=config.first_step_min,
                                  uneven_grace=config.uneven_grace,
                                  silence_warning=config.silence_warning, warn=_log.warning)
        self._events: queue.Queue[Worker] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._finished: set[int] = set()
        self._next_check = time.monotonic() + _CHECK_EVERY

    @contextlib.contextmanager
    def starting(self) -> Iterator[Callable[[Worker], None]]:
        """Around the starts: yields ``add``. The waiter threads start after the last
        fork (a ``preexec_fn`` runs in a one-thread parent); a failed start stops the
        workers already started."""
        try:
            yield self.workers.append
        except BaseException:
            self._start_waiters()
            self.stop()
            raise
        self._start_waiters()

    def _start_waiters(self) -> None:
        for w in self.workers:
            t = threading.Thread(target=w._watch_exit, args=(self._events,), daemon=True,
                                 name=f"fleet-wait-rank{w.rank}")
            t.start()
            self._threads.append(t)

    def run(self, stopped: Callable[[], int | None] = lambda: None,
            tick: Callable[[], None] = lambda: None,
            deadline: float | None = None) -> Outcome | None:
        """Until every worker exits 0 (``Outcome()``), one fails or is stuck, or the
        launcher is signalled (``stopped()`` names the signal); ``None`` once
        ``deadline`` (``time.monotonic()``) passes. ``tick`` runs after each wait (at
        least every ``_POLL`` seconds)."""
        while True:
            signum = stopped()
            if signum is not None:
                return Outcome(signum=signum)
            wait = _POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))
            try:
                w = self._events.get(timeout=wait)
            except queue.Empty:
                w = None
            tick()
            if w is not None:
                if w.failed:
                    return Outcome(failure=self._culprit(w).failure())
                self._finished.add(w.rank)
                if len(self._finished) == len(self.workers):
                    return Outcome()
            elif time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + _CHECK_EVERY
                stuck = self._watchdog.check(each.watched() for each in self.workers)
                if stuck is not None:
                    worker = next(each for each in self.workers if each.rank == stuck.rank)
                    return Outcome(failure=worker.failure(stuck=stuck))
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _culprit(self, first: Worker) -> Worker:
        """The failed worker to name, given the first failure heard of: the exits that
        arrive within ``_SETTLE`` seconds count too, and a death by a signal comes
        first (a killed peer makes the others raise in their collectives)."""
        if first.returncode < 0:  # killed by a signal: nothing can come before it
            return first
        failed = [first]
        deadline = time.monotonic() + _SETTLE
        while (left := deadline - time.monotonic()) > 0:
            try:
                w = self._events.get(timeout=left)
            except queue.Empty:
                break
            if w.failed:
                failed.append(w)
        # A signal death first; then the worker whose script says it failed first
        # (fleet.runtime._heartbeat.mark_failed): a peer that failed because it went, later.
        def failed_at(w: Worker) -> float:
            at = read_progress(w.spec.environ.get(_heartbeat.ENV, "")).failed_at
            return float("inf") if at is None else at

        return min(failed, key=lambda w: (w.returncode >= 0, failed_at(w), failed.index(w)))

    def stopped_ranks(self) -> list[int]:
        """The ranks of the live workers that are stopped (``SIGSTOP``, a debugger)."""
        return [w.rank for w in self.workers
                if not w.exited.is_set() and process_state(w.pid) in STOPPED_STATES]

    def stop(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM (+SIGCONT) to every live worker, SIGKILL to all after
        ``TERMINATE_GRACE`` s (or as soon as ``hurry()``), then :meth:`reap`."""
        alive = [w for w in self.workers if not w.exited.is_set()]
        for w in alive:
            w.send_signal(signal.SIGTERM)
            w.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + TERMINATE_GRACE
        for w in alive:
            while not w.exited.wait(0.05) and time.monotonic() < deadline:
                if hurry():
                    deadline = 0.0
        self.reap()

    def reap(self) -> None:
        """SIGKILL to every group (leftover children too), then waits for every worker
        and its waiter thread."""
        for w in self.workers:
            w.send_signal(signal.SIGKILL)
        for w in self.workers:
            w.exited.wait(10.0)
        for t in self._threads:
            t.join(timeout=10)
