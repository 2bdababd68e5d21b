"""``fleet.spawn``: Paddle's ``paddle.distributed.spawn`` on fleet's launcher.

Each process is started with the ``spawn`` start method and the environment a
``fleetrun`` worker gets (rank, world size, coordinator on loopback, ...), calls
``func(*args)`` and sends its return value back to the parent. The first
failure (an exception, a non-zero exit, a signal, a stuck process) stops the
others and is raised in the parent as :class:`fleet.launch.WorkerFailedError`
with the child's traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from fleet import _worker
from fleet._errors import FleetConfigError, FleetTypeError
from fleet.launch import _stop, _tables
from fleet.launch._args import ALIASES
from fleet.launch._args import OPTIONS as _CLI_OPTIONS
from fleet.launch._config import (
    LaunchConfig,
    WorkerSpec,
    plan_workers,
    resolve,
    worker_base_environ,
)
from fleet.launch._failure import STUCK_EXIT_CODE, WorkerFailedError, describe_returncode, exit_code_of
from fleet.launch._stop import die_with_parent
from fleet.launch._watchdog import Watchdog, Watched

# fleetrun's options that fleet.spawn takes too (fleet/launch/_args.py is their one
# table: types, defaults, aliases), and its own ``print_config``.
_SHARED = ("cpu_devices", "gpus", "job_id", "master", "progress_timeout", "first_step_min",
           "uneven_grace", "verbose_env")
_NAMES = {alias: name for name in _SHARED for alias in (name, *ALIASES.get(name, ()))}
OPTIONS = tuple(sorted([*_SHARED, "print_config"]))
_ALIASES_TEXT = "; ".join(f"{', '.join(ALIASES[n])} for {n}" for n in _SHARED if n in ALIASES)
_CHECK_EVERY = 0.5
_environ_lock = threading.Lock()


def spawn(func: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = -1,
          join: bool = True, daemon: bool = False, **options: Any) -> SpawnContext:
    """Runs ``func(*args)`` in ``nprocs`` new processes, one data-parallel worker each.

    Args:
        func: a module-level function (it is pickled by name); it calls
            ``fleet.init(is_collective=True)`` like a script would.
        args: the arguments of ``func``.
        nprocs: number of processes; -1: one per visible GPU, else 1.
        join: wait for the processes (else call ``join()`` on the returned context).
        daemon: make the processes daemonic.
        **options: fleetrun's options of the same names (``fleet/launch/_args.py``):
            ``gpus`` (``selected_gpus``, ``devices``): GPU ids such as ``"4,5"``, one
            per process; ``cpu_devices``: N CPU devices per process; ``master``:
            ``"127.0.0.1:PORT"`` for the coordinator (default: a free loopback port);
            ``job_id``; ``progress_timeout``, ``first_step_min`` and ``uneven_grace``
            (seconds); ``verbose_env``; and
            ``print_config``: print the configuration and environment tables.

    Returns:
        A :class:`SpawnContext`; after ``join`` its ``return_values[rank]`` holds
        what ``func`` returned in each process.

    Raises:
        fleet.FleetConfigError: an unknown option or a bad value, before any start.
        fleet.FleetTypeError: ``func`` or ``args`` do not pickle (a lambda, a local
            function), before any start.
        WorkerFailedError: a process failed; it carries the child's traceback.

    Example:
        >>> def train(scale):             # in an importable module
        ...     import fleet
        ...     fleet.init(is_collective=True)
        ...     return fleet.worker_index() * scale
        >>> fleet.spawn(train, args=(10,), nprocs=2, cpu_devices=2).return_values  # doctest: +SKIP
        [0, 10]
    """
    _check_picklable(func, args)
    config = resolve(_config_from_options(nprocs, options))
    if options.get("print_config"):
        print(_tables.config_table(config.table()), flush=True)
    heartbeat_dir = tempfile.mkdtemp(prefix="fleet-heartbeat-")
    specs = plan_workers(config, 0, heartbeat_dir)
    if options.get("print_config"):
        print(_tables.env_table(specs[0].environ, config.verbose_env), flush=True)
    ctx = multiprocessing.get_context("spawn")
    base = worker_base_environ(os.environ)
    context = SpawnContext(config, specs, heartbeat_dir)
    try:
        for spec in specs:
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_child_main, args=(func, tuple(args), writer, os.getpid()),
                                  daemon=daemon, name=f"fleet-spawn-rank{spec.rank}")
            with _environ({**base, **spec.environ}):
                process.start()
            writer.close()
            context._add(process, reader)
    except BaseException:
        context._stop()
        raise
    if join:
        while not context.join():
            pass
    return context


def _check_picklable(func: Callable[..., Any], args: Sequence[Any]) -> None:
    """The children get ``func`` and ``args`` by pickle: refuse what will not pickle."""
    if not callable(func):
        raise FleetTypeError(f"fleet.spawn needs a function, got {type(func).__name__} {func!r}")
    name = getattr(func, "__qualname__", repr(func))
    try:
        pickle.dumps(func)
    except Exception as e:  # noqa: BLE001 (PicklingError, AttributeError, TypeError...)
        kind = ("a lambda" if "<lambda>" in name else
                "a local function" if "<locals>" in name else "not picklable")
        raise FleetTypeError(
            f"fleet.spawn cannot send {name!r} to the new processes: it is {kind} "
            f"(pickle: {type(e).__name__}: {e}). Give a function defined at the top level "
            "of an importable module (not __main__ of an interactive session), e.g. "
            "def train(lr): ... in train.py, and fleet.spawn(train, args=(0.1,))"
        ) from None
    try:
        pickle.dumps(tuple(args))
    except Exception as e:  # noqa: BLE001
        raise FleetTypeError(
            f"fleet.spawn cannot send args={args!r} to the new processes (pickle: "
            f"{type(e).__name__}: {e}); pass values that pickle (numbers, strings, arrays)"
        ) from None


def _config_from_options(nprocs: int, options: dict[str, Any]) -> LaunchConfig:
    unknown = sorted(set(options) - set(OPTIONS) - set(_NAMES))
    if unknown:
        hints = {n: difflib.get_close_matches(n, OPTIONS, n=1) for n in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                         for n, h in hints.items())
        raise FleetConfigError(
            f"fleet.spawn got unknown option(s) {said}; valid options: {', '.join(OPTIONS)} "
            f"(aliases: {_ALIASES_TEXT})"
        )
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or (nprocs < 1 and nprocs != -1):
        raise FleetConfigError(
            f"nprocs={nprocs!r} must be a positive integer, or -1 for one process per "
            "visible GPU (1 without GPUs)"
        )
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key == "print_config":
            continue
        name = _NAMES[key]
        if name in values:
            raise FleetConfigError(f"fleet.spawn got {name!r} twice (as {key!r} too)")
        values[name] = _option_value(name, value)
    return LaunchConfig(nproc_per_node=None if nprocs == -1 else nprocs, **values)


def _option_value(name: str, value: Any) -> Any:
    """A keyword option as its field: text goes through fleetrun's own converter."""
    convert, default, _ = _CLI_OPTIONS[name]
    if value is None:
        return default
    if name == "gpus" and not isinstance(value, str):
        value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if isinstance(value, str):
        try:
            return convert(value)
        except ValueError:
            raise FleetConfigError(f"fleet.spawn option {name}={value!r} is not valid") from None
    if name in ("progress_timeout", "first_step_min", "uneven_grace"):
        return float(value)
    return value


@contextlib.contextmanager
def _environ(environ: dict[str, str]):
    """``os.environ`` is ``environ`` while a child starts (spawn copies it at exec)."""
    with _environ_lock:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(environ)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _child_main(func: Callable[..., Any], args: tuple, conn: Any, parent_pid: int) -> None:
    os.setsid()  # its own process group: the parent stops it with all its children
    die_with_parent(parent_pid)
    try:
        result = func(*args)
        _worker.mark_finished()
    except SystemExit as e:
        if e.code not in (None, 0):
            _send_error(conn, traceback.format_exc(), e.code if isinstance(e.code, int) else 1)
        result = None
    except BaseException:
        _send_error(conn, traceback.format_exc())
    try:
        conn.send(("ok", result))
    except Exception as e:  # noqa: BLE001 (an unpicklable return value)
        _send_error(conn, f"the return value of {getattr(func, '__name__', func)!r} could not "
                          f"be sent to the parent (it must pickle): {type(e).__name__}: {e}\n")
    conn.close()


def _send_error(conn: Any, text: str, code: int = 1) -> None:
    with contextlib.suppress(Exception):
        conn.send(("error", text))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter exit: jax.distributed's shutdown would wait for the healthy peers.
    os._exit(code)


class SpawnContext:
    """The processes of one ``fleet.spawn`` call.

    Attributes:
        processes: the ``multiprocessing.Process`` objects, in rank order.
        return_values: what ``func`` returned in each process (after ``join``).
    """

    def __init__(self, config: LaunchConfig, specs: list[WorkerSpec], heartbeat_dir: str):
        self.config, self.specs, self._heartbeat_dir = config, specs, heartbeat_dir
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.return_values: list[Any] = [None] * len(specs)
        self._readers: list[Any] = []
        self._errors: dict[int, str] = {}
        self._done: set[int] = set()
        self._watchdog = Watchdog(config.progress_timeout, first_step_min=config.first_step_min,
                                  uneven_grace=config.uneven_grace)
        self._started = time.time()

    def _add(self, process: Any, reader: Any) -> None:
        self.processes.append(process)
        self._readers.append(reader)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` s (``None``: until something happens); ``True`` once
        every process finished. Raises :class:`WorkerFailedError` on the first failure,
        after stopping the other processes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while len(self._done) < len(self.processes):
                waiting = {p.sentinel: r for r, p in enumerate(self.processes) if r not in self._done}
                waiting.update({c: r for r, c in enumerate(self._readers) if not c.closed})
                left = _CHECK_EVERY if deadline is None else min(_CHECK_EVERY,
                                                                  deadline - time.monotonic())
                ready = multiprocessing.connection.wait(list(waiting), max(left, 0))
                exited = []
                for obj in ready:
                    rank = waiting[obj]
                    if obj is self.processes[rank].sentinel:
                        exited.append(rank)
                    else:
                        self._receive(rank)
                for rank in exited:
                    self._receive(rank)
                    self.processes[rank].join()
                    self._done.add(rank)
                failed = [r for r in exited
                          if self.processes[r].exitcode != 0 or r in self._errors]
                if failed:  # signal deaths first: a killed peer makes the others raise
                    self._fail(min(failed, key=lambda r: (self.processes[r].exitcode >= 0, r)))
                self._check_stuck()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        except KeyboardInterrupt:
            self._stop()
            raise
        if len(self._done) == len(self.processes):
            self._stop()  # leftover children of the workers, and the heartbeat files
            return True
        return False

    def _receive(self, rank: int) -> None:
        reader = self._readers[rank]
        while not reader.closed:
            try:
                if not reader.poll(0):
                    return
                kind, value = reader.recv()
            except (EOFError, OSError):
                reader.close()
                return
            if kind == "ok":
                self.return_values[rank] = value
            else:
                self._errors[rank] = value

    def _check_stuck(self) -> None:
        stuck = self._watchdog.check(
            Watched(r, p.pid, self.specs[r].environ["FLEET_HEARTBEAT_FILE"],
                    started=self._started, finished=r in self._done and p.exitcode == 0)
            for r, p in enumerate(self.processes)
        )
        if stuck is not None:
            self._fail(stuck.rank, stuck=stuck.reason)

    def _fail(self, rank: int, stuck: str | None = None) -> None:
        self._stop()
        process = self.processes[rank]
        where = f"fleet.spawn: process {rank} (pid {process.pid})"
        if stuck is not None:
            exitcode, how = STUCK_EXIT_CODE, f"is stuck: {stuck}"
        else:
            exitcode = exit_code_of(process.exitcode) or 1
            how = describe_returncode(process.exitcode)
        tb = self._errors.get(rank)
        message = (f"{where} raised an exception; the other processes were stopped. "
                   f"Its traceback:\n\n{tb}" if tb else
                   f"{where} {how}; the other processes were stopped")
        raise WorkerFailedError(message, rank=rank, exitcode=exitcode, worker_traceback=tb)

    def _stop(self) -> None:
        _stop.stop([_Child(p) for p in self.processes])
        for r in range(len(self.processes)):
            self._done.add(r)
        shutil.rmtree(self._heartbeat_dir, ignore_errors=True)


class _Child:
    """A ``multiprocessing`` process as ``_stop`` sees a worker."""

    def __init__(self, process: Any):
        self._process = process

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def has_exited(self) -> bool:
        return self._process.exitcode is not None

    def wait_exit(self, timeout: float) -> bool:
        self._process.join(timeout)
        return self._process.exitcode is not None
