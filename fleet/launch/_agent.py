"""``fleetrun``'s run of one node: start the script's workers, echo one, restart.

Each worker is ``python -u _run.py SCRIPT ARGS`` in a session (and process group)
of its own, with its output in ``log_dir/workerlog.RANK``, watched and stopped by
the supervisor ``fleet.spawn`` uses too (``fleet/launch/_supervisor.py``). This
file is what is ``fleetrun``'s own: how a worker starts (:class:`ScriptWorker`),
the echo of worker 0's log, the launcher's signals, the report and the restarts.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from fleet._errors import FleetConfigError
from fleet.launch import _tables
from fleet.launch._config import LaunchConfig, make_log_dir
from fleet.launch._failure import Failure, signal_name
from fleet.launch._rendezvous import Stopped
from fleet.launch._rendezvous_join import meet
from fleet.launch._supervisor import Outcome, Supervisor, Worker, die_with_parent
from fleet.launch._worker_plan import WorkerSpec, plan_workers, worker_base_environ

log = logging.getLogger("fleet.launch")

#: Each worker runs ``python -u _run.py SCRIPT ARGS`` (see fleet/launch/_run.py).
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_run.py")


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

    def first(self) -> int | None:
        """The first signal received (``None``: none yet)."""
        return self.received[0] if self.received else None

    def another(self) -> Callable[[], bool]:
        """Whether a signal came after this call: a second Ctrl-C hurries the stop."""
        seen = len(self.received)
        return lambda: len(self.received) > seen


class LogFollower:
    """Echoes the new lines of a log file from ``offset`` on, less those ``skip`` says."""

    def __init__(self, path: str, offset: int, out: IO[str],
                 skip: Callable[[str], bool] | None = None):
        self._file = open(path, "rb")  # noqa: SIM115 (closed in close())
        self._file.seek(offset)
        self._out, self._partial = out, b""
        self._skip = skip or (lambda line: False)

    def poll(self, final: bool = False) -> None:
        data = self._file.read()
        if data:
            *lines, self._partial = (self._partial + data).split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                if not self._skip(line):
                    self._out.write(line + "\n")
        if final and self._partial:
            self._out.write(self._partial.decode("utf-8", "replace") + "\n")
            self._partial = b""
        self._out.flush()

    def close(self) -> None:
        self.poll(final=True)
        self._file.close()


class ScriptWorker(Worker):
    """A worker of ``fleetrun``: a ``Popen`` of the runner, its output in a log file."""

    def __init__(self, spec: WorkerSpec, proc: subprocess.Popen, log_path: str, offset: int):
        super().__init__(spec, proc.pid)
        self.proc, self.log_path, self.log_offset = proc, log_path, offset

    def _wait_for_exit(self) -> int:
        return self.proc.wait()


def start_workers(config: LaunchConfig, specs: list[WorkerSpec],
                  restart_count: int) -> Supervisor:
    """Starts one attempt's workers: ``python -u _run.py SCRIPT ARGS``, each in a
    session of its own, its output appended to ``workerlog.RANK`` after a restart."""
    base = worker_base_environ(os.environ)
    command = [sys.executable, "-u", RUNNER, config.training_script,
               *config.training_script_args]
    preexec = functools.partial(die_with_parent, os.getpid())
    supervisor = Supervisor(config)
    with supervisor.starting() as add:
        for spec in specs:
            path = os.path.join(config.log_dir, f"workerlog.{spec.rank}")
            with open(path, "ab" if restart_count else "wb") as log_file:
                if restart_count:
                    log_file.write(f"----- restart {restart_count} -----\n".encode())
                    log_file.flush()
                offset = log_file.tell()
                proc = subprocess.Popen(
                    command, env={**base, **spec.environ}, stdin=subprocess.DEVNULL,
                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=preexec,
                )
                add(ScriptWorker(spec, proc, path, offset))
    return supervisor


def watch(supervisor: Supervisor, config: LaunchConfig, signals: SignalCatcher,
          out: IO[str], restart: int = 0) -> Outcome:
    """Runs the supervisor with worker 0's log echoed to ``out`` as it is written, after
    the start's one line (``_tables.start_line``; the INFO line under ``--print_config``)."""
    first = supervisor.workers[0]  # echoed as it is: one rank's lines, nothing mixes
    if config.tables:
        log.info("rank %d's output follows (every worker's: %s)", first.rank,
                 os.path.join(config.log_dir, "workerlog.N"))
    else:
        out.write(_tables.start_line(config, first.rank, restart) + "\n")
        out.flush()
    skip = None if config.tables else _tables.quiet_line
    follower = LogFollower(first.log_path, first.log_offset, out, skip)
    try:
        return supervisor.run(stopped=signals.first, tick=follower.poll)
    finally:
        follower.close()


def launch(config: LaunchConfig, out: IO[str] | None = None) -> int:
    """Runs this node's share of a resolved config; returns the launcher's exit code.

    0 when every worker exits 0; the failed worker's exit code (128 + N for a death
    by signal N, 124 for a stuck worker) after the last allowed restart; 128 + N
    when the launcher itself gets signal N (SIGINT, SIGTERM, SIGHUP).
    """
    out = sys.stdout if out is None else out
    make_log_dir(config.log_dir)  # (fleetrun's main has checked it already)
    heartbeat_dir = tempfile.mkdtemp(prefix="fleet-heartbeat-")
    restart = 0
    if config.tables:  # Paddle's opening line; by default the start's one line says it
        log.info("Run collective mode: %s on node %d of %d, %d in the job",
                 _tables.devices_phrase(config), config.node_rank, config.nnodes,
                 config.world_size)
    try:
        with SignalCatcher() as signals:
            if config.nnodes > 1:
                code = _meet(config, signals)
                if code is not None:
                    return code
            while True:
                code = _attempt(config, restart, heartbeat_dir, signals, out)
                if code is not None:
                    return code
                restart += 1
    finally:
        shutil.rmtree(heartbeat_dir, ignore_errors=True)


def _meet(config: LaunchConfig, signals: SignalCatcher) -> int | None:
    """The nodes' rendezvous before the first start (``_rendezvous.py``): ``None`` when
    every node came and agrees, else the launcher's exit code (2, or 128 + N)."""
    try:
        meet(config, signals.first)
    except Stopped as e:
        log.warning("got %s while the nodes met: no worker started", signal_name(e.signum))
        return 128 + e.signum
    except FleetConfigError as e:
        log.error("%s", e)
        return 2
    return None


def _attempt(config: LaunchConfig, restart: int, heartbeat_dir: str, signals: SignalCatcher,
             out: IO[str]) -> int | None:
    """One start of every worker; the launcher's exit code, or ``None`` to restart."""
    for name in os.listdir(heartbeat_dir):
        os.unlink(os.path.join(heartbeat_dir, name))
    specs = plan_workers(config, restart, heartbeat_dir)
    if config.tables:
        log.info(
            "Local start %d processes%s. First process distributed environment "
            "info (Only For Debug):\n%s", len(specs), f" (restart {restart})" if restart else "",
            _tables.env_table(specs[0].environ, config.verbose_env),
        )
    supervisor = start_workers(config, specs, restart)
    outcome = watch(supervisor, config, signals, out, restart)
    if outcome.signum is not None:
        log.warning("got %s: stopping all %d workers", signal_name(outcome.signum), len(specs))
        supervisor.stop(hurry=signals.another())
        return 128 + outcome.signum
    if outcome.failure is None:
        supervisor.reap()
        log.info("all %d workers finished", len(specs))
        return 0
    _report(supervisor, outcome.failure, signals)
    if signals.received:  # stopped by hand while stopping: no restart
        return 128 + signals.received[0]
    if restart < config.max_restarts:
        log.warning("restarting all %d workers (restart %d of %d)", len(specs), restart + 1,
                    config.max_restarts)
        return None
    log.error("job failed: rank %d %s; exit code %d", outcome.failure.rank,
              outcome.failure.short, outcome.failure.exit_code)
    return outcome.failure.exit_code


def _report(supervisor: Supervisor, failure: Failure, signals: SignalCatcher) -> None:
    """Names the failed worker, stops the others, and prints its last lines."""
    stopped = [r for r in supervisor.stopped_ranks() if r != failure.rank]
    log.error("%s; stopping the other workers", failure.summary())
    if stopped:
        log.error("note: rank(s) %s %s stopped (SIGSTOP?) and may be the cause",
                  ", ".join(map(str, stopped)), "is" if len(stopped) == 1 else "are")
    started = time.monotonic()
    supervisor.stop(hurry=signals.another())
    log.info("stopped all workers in %.1f s", time.monotonic() - started)
    tail = failure.log_tail()
    log.error(
        "last %d lines of %s (rank %d):\n%s", len(tail), failure.log_path, failure.rank,
        "\n".join(f"[rank {failure.rank}] {line}" for line in tail),
    )
