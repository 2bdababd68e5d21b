"""Runs one node's workers: start, echo, watch, stop, restart.

Each worker is ``python -u SCRIPT ARGS`` in a session (and process group) of its
own, with its output in ``log_dir/workerlog.RANK``. One thread per worker waits
for its exit, so the launcher learns the order in which workers died and names
the first. Workers are stopped as ``fleet/launch/_stop.py`` says (shared with
``fleet.spawn``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from fleet.launch import _stop, _tables
from fleet.launch._config import LaunchConfig, WorkerSpec, plan_workers, worker_base_environ
from fleet.launch._failure import Failure, signal_name
from fleet.launch._stop import TERMINATE_GRACE, die_with_parent
from fleet.launch._watchdog import STOPPED_STATES, Watchdog, Watched, process_state

log = logging.getLogger("fleet.launch")

#: Each worker runs ``python -u _run.py SCRIPT ARGS`` (see fleet/launch/_run.py).
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_run.py")
_POLL = 0.1  # seconds between looks at exits and at worker 0's log
_CHECK_EVERY = 0.5  # seconds between watchdog checks
# After the first failure, how long other exits may still arrive before the culprit is
# named: a worker killed by a signal makes its peers fail in their next collective, and
# their exits may reach the launcher first.
_SETTLE = 0.5


class SignalCatcher:
    """Turns SIGINT / SIGTERM / SIGHUP to the launcher into a flag its loops read."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self._old: dict[int, object] = {}

    def __enter__(self) -> SignalCatcher:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


class LogFollower:
    """Echoes the new lines of a log file, each prefixed with the rank that wrote it."""

    def __init__(self, path: str, offset: int, prefix: str, out: IO[str]):
        self._file = open(path, "rb")  # noqa: SIM115 (closed in close())
        self._file.seek(offset)
        self._prefix, self._out, self._partial = prefix, out, b""

    def poll(self, final: bool = False) -> None:
        data = self._file.read()
        if data:
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                self._out.write(self._prefix + line.decode("utf-8", "replace") + "\n")
        if final and self._partial:
            self._out.write(self._prefix + self._partial.decode("utf-8", "replace") + "\n")
            self._partial = b""
        self._out.flush()

    def close(self) -> None:
        self.poll(final=True)
        self._file.close()


class _Worker:
    def __init__(self, spec: WorkerSpec, proc: subprocess.Popen, log_path: str, offset: int):
        self.spec, self.proc, self.log_path, self.log_offset = spec, proc, log_path, offset
        self.started = time.time()
        self.returncode: int | None = None
        self.exited = threading.Event()

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def pid(self) -> int:
        return self.proc.pid

    def has_exited(self) -> bool:
        return self.exited.is_set()

    def wait_exit(self, timeout: float) -> bool:
        return self.exited.wait(timeout)

    def wait(self, events: queue.Queue) -> None:
        self.returncode = self.proc.wait()
        self.exited.set()
        events.put(self)

    def watched(self) -> Watched:
        return Watched(self.rank, self.proc.pid, self.spec.environ["FLEET_HEARTBEAT_FILE"],
                       started=self.started,
                       finished=self.exited.is_set() and self.returncode == 0)

    def failure(self, stuck: str | None = None) -> Failure:
        return Failure(rank=self.rank, pid=self.proc.pid, returncode=self.returncode,
                       stuck=stuck, log_path=self.log_path, log_offset=self.log_offset)


@dataclasses.dataclass(frozen=True)
class Outcome:
    failure: Failure | None = None
    signum: int | None = None


class WorkerGroup:
    """One attempt: this node's workers, started together and stopped together."""

    def __init__(self, config: LaunchConfig, specs: list[WorkerSpec], restart_count: int,
                 out: IO[str]):
        self.config, self.specs, self.restart_count, self.out = config, specs, restart_count, out
        self.workers: list[_Worker] = []
        self._events: queue.Queue[_Worker] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        base = worker_base_environ(os.environ)
        command = [sys.executable, "-u", RUNNER, self.config.training_script,
                   *self.config.training_script_args]
        preexec = functools.partial(die_with_parent, os.getpid())
        try:
            for spec in self.specs:
                path = os.path.join(self.config.log_dir, f"workerlog.{spec.rank}")
                with open(path, "ab" if self.restart_count else "wb") as log_file:
                    if self.restart_count:
                        log_file.write(f"----- restart {self.restart_count} -----\n".encode())
                        log_file.flush()
                    offset = log_file.tell()
                    proc = subprocess.Popen(
                        command, env={**base, **spec.environ}, stdin=subprocess.DEVNULL,
                        stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                        preexec_fn=preexec,
                    )
                    self.workers.append(_Worker(spec, proc, path, offset))
        finally:  # waiters start after every fork: preexec_fn runs in a one-thread parent
            for w in self.workers:
                t = threading.Thread(target=w.wait, args=(self._events,), daemon=True,
                                     name=f"fleet-wait-rank{w.rank}")
                t.start()
                self._threads.append(t)

    def watch(self, signals: SignalCatcher) -> Outcome:
        """Until every worker exits 0 (``Outcome()``), one fails, or the launcher is signalled."""
        first = self.workers[0]  # echoed as it is: one rank's lines, nothing mixes
        log.info("rank %d's output follows (every worker's: %s)", first.rank,
                 os.path.join(self.config.log_dir, "workerlog.N"))
        follower = LogFollower(first.log_path, first.log_offset, "", self.out)
        watchdog = Watchdog(self.config.progress_timeout,
                            first_step_min=self.config.first_step_min,
                            uneven_grace=self.config.uneven_grace)
        remaining = {w.rank for w in self.workers}
        next_check = time.monotonic() + _CHECK_EVERY
        try:
            while True:
                if signals.received:
                    return Outcome(signum=signals.received[0])
                try:
                    w = self._events.get(timeout=_POLL)
                except queue.Empty:
                    w = None
                follower.poll()
                if w is not None:
                    if w.returncode != 0:
                        return Outcome(failure=self._culprit(w).failure())
                    remaining.discard(w.rank)
                    if not remaining:
                        return Outcome()
                    continue
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + _CHECK_EVERY
                    stuck = watchdog.check(w.watched() for w in self.workers)
                    if stuck is not None:
                        worker = next(w for w in self.workers if w.rank == stuck.rank)
                        return Outcome(failure=worker.failure(stuck=stuck.reason))
        finally:
            follower.close()

    def _culprit(self, first: _Worker) -> _Worker:
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
            if w.returncode != 0:
                failed.append(w)
        return min(failed, key=lambda w: (w.returncode >= 0, failed.index(w)))

    def stopped_ranks(self) -> list[int]:
        return [w.rank for w in self.workers
                if not w.exited.is_set() and process_state(w.proc.pid) in STOPPED_STATES]

    def stop(self, signals: SignalCatcher | None = None, grace: float = TERMINATE_GRACE) -> None:
        """Stops every worker (``_stop.stop``); a second signal to the launcher hurries."""
        seen = len(signals.received) if signals else 0
        _stop.stop(self.workers, grace,
                   hurry=lambda: signals is not None and len(signals.received) > seen)
        self._join_waiters()

    def reap(self) -> None:
        """SIGKILL to every group (leftover children too), then wait for every worker."""
        _stop.kill(self.workers)
        self._join_waiters()

    def _join_waiters(self) -> None:
        for t in self._threads:
            t.join(timeout=10)


def launch(config: LaunchConfig, out: IO[str] | None = None) -> int:
    """Runs this node's share of a resolved config; returns the launcher's exit code.

    0 when every worker exits 0; the failed worker's exit code (128 + N for a death
    by signal N, 124 for a stuck worker) after the last allowed restart; 128 + N
    when the launcher itself gets signal N (SIGINT, SIGTERM, SIGHUP).
    """
    out = sys.stdout if out is None else out
    os.makedirs(config.log_dir, exist_ok=True)
    heartbeat_dir = tempfile.mkdtemp(prefix="fleet-heartbeat-")
    restart = 0
    devices = (f"GPU {','.join(config.gpus)}" if config.gpus is not None else
               f"CPU, {config.cpu_devices} devices each" if config.cpu_devices is not None else
               "devices as inherited")
    log.info("Run collective mode: %d processes on node %d of %d (%s), %d in the job",
             config.nproc_per_node, config.node_rank, config.nnodes, devices, config.world_size)
    try:
        with SignalCatcher() as signals:
            while True:
                for name in os.listdir(heartbeat_dir):
                    os.unlink(os.path.join(heartbeat_dir, name))
                specs = plan_workers(config, restart, heartbeat_dir)
                log.info(
                    "Local start %d processes%s. First process distributed environment "
                    "info (Only For Debug):\n%s", len(specs),
                    f" (restart {restart})" if restart else "",
                    _tables.env_table(specs[0].environ, config.verbose_env),
                )
                group = WorkerGroup(config, specs, restart, out)
                group.start()
                outcome = group.watch(signals)
                if outcome.signum is not None:
                    log.warning("got %s: stopping all %d workers", signal_name(outcome.signum),
                                len(specs))
                    group.stop(signals)
                    return 128 + outcome.signum
                if outcome.failure is None:
                    group.reap()
                    log.info("all %d workers finished", len(specs))
                    return 0
                _report(group, outcome.failure, signals)
                if signals.received:  # stopped by hand while stopping: no restart
                    return 128 + signals.received[0]
                if restart < config.max_restarts:
                    restart += 1
                    log.warning("restarting all %d workers (restart %d of %d)", len(specs),
                                restart, config.max_restarts)
                    continue
                log.error("job failed: rank %d %s; exit code %d", outcome.failure.rank,
                          outcome.failure.short, outcome.failure.exit_code)
                return outcome.failure.exit_code
    finally:
        shutil.rmtree(heartbeat_dir, ignore_errors=True)


def _report(group: WorkerGroup, failure: Failure, signals: SignalCatcher) -> None:
    stopped = [r for r in group.stopped_ranks() if r != failure.rank]
    log.error("%s; stopping the other workers", failure.summary())
    if stopped:
        log.error("note: rank(s) %s %s stopped (SIGSTOP?) and may be the cause",
                  ", ".join(map(str, stopped)), "is" if len(stopped) == 1 else "are")
    started = time.monotonic()
    group.stop(signals)
    log.info("stopped all workers in %.1f s", time.monotonic() - started)
    tail = failure.log_tail()
    log.error(
        "last %d lines of %s (rank %d):\n%s", len(tail), failure.log_path, failure.rank,
        "\n".join(f"[rank {failure.rank}] {line}" for line in tail),
    )
