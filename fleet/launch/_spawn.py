"""``fleet.spawn``: Paddle's ``paddle.distributed.spawn`` on fleet's launcher.

Each process starts with the ``spawn`` start method and the environment a
``fleetrun`` worker gets, calls ``func(*args)`` and sends its return value back;
the first failure stops the others and is raised in the parent with the child's
traceback (:func:`spawn`). The processes are watched and stopped by the
supervisor ``fleetrun`` uses too (``fleet/launch/_supervisor.py``); this file is
what is ``fleet.spawn``'s own: what it refuses before any start (a function or
arguments that do not pickle, a call outside the ``__main__`` guard; its options:
``fleet/launch/_args.py``), how a child starts and what it sends back
(:class:`SpawnedWorker`, :func:`_child_main`), and the failure as an exception.
"""

from __future__ import annotations

import contextlib
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

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.io import _main_guard
from fleet.launch import _tables
from fleet.launch._args import spawn_config
from fleet.launch._config import LaunchConfig, resolve
from fleet.launch._failure import Failure, WorkerFailedError
from fleet.launch._supervisor import Supervisor, Worker, die_with_parent
from fleet.launch._worker_plan import WorkerSpec, plan_workers, worker_base_environ
from fleet.runtime import _heartbeat

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
            ``job_id``; ``progress_timeout``, ``first_step_min``, ``uneven_grace`` and
            ``silence_warning`` (seconds); ``allow_oversubscribe`` (more than 8
            CPU processes per core); ``verbose_env``; and
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
    check_picklable(func, args)
    _check_main_guard(nprocs)
    config = resolve(spawn_config(nprocs, options))
    if options.get("print_config"):
        print(_tables.config_table(config.table()), flush=True)
    heartbeat_dir = tempfile.mkdtemp(prefix="fleet-heartbeat-")
    specs = plan_workers(config, 0, heartbeat_dir)
    if options.get("print_config"):
        print(_tables.env_table(specs[0].environ, config.verbose_env), flush=True)
    context = SpawnContext(config, specs, heartbeat_dir)
    try:
        context._start(func, tuple(args), daemon)
    except BaseException:
        context._stop()
        raise
    if join:
        while not context.join():
            pass
    return context


def check_picklable(func: Callable[..., Any], args: Sequence[Any]) -> None:
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


def _check_main_guard(nprocs: int) -> None:
    """Refuses a call from the main script's code outside its ``__main__`` guard.

    Each process starts with ``spawn``, which imports the main script again (as
    ``__mp_main__``): an unguarded ``fleet.spawn(...)`` line runs again there, and
    Python refuses to start processes from a process that is starting (a
    ``RuntimeError`` only the child's stderr shows; the parent would see "process
    0 exited with code 1"). The DataLoader's workers have the same need
    (``fleet/io/_main_guard.py`` finds the line)."""
    found = _main_guard.unguarded_line()
    if found is None:
        return
    path, line = found
    raise FleetConfigError(
        f"fleet.spawn(nprocs={nprocs}) is called from line {line} of {path}, outside an "
        "`if __name__ == \"__main__\":` block. Its processes start with spawn, which "
        "imports the script again in each of them, where that line would run again "
        "(Python refuses, and every process dies before it runs the function). Put the "
        "call under the guard: def main(): fleet.spawn(train, ...)  then  "
        "if __name__ == \"__main__\": main()"
    )


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
        self._supervisor = Supervisor(config)
        self._ended = False

    def _start(self, func: Callable[..., Any], args: tuple, daemon: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        base = worker_base_environ(os.environ)
        with self._supervisor.starting() as add:
            for spec in self.specs:
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_child_main, args=(func, args, writer, os.getpid()),
                                      daemon=daemon, name=f"fleet-spawn-rank{spec.rank}")
                with _environ({**base, **spec.environ}):
                    process.start()
                writer.close()
                self.processes.append(process)
                add(SpawnedWorker(spec, process, reader, self.return_values))

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` s (``None``: until something happens); ``True`` once
        every process finished. Raises :class:`WorkerFailedError` on the first failure,
        after stopping the other processes."""
        if self._ended:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            outcome = self._supervisor.run(deadline=deadline)
        except KeyboardInterrupt:
            self._stop()
            raise
        if outcome is None:
            return False
        self._stop()  # the others; else leftover children of the workers, and the heartbeats
        if outcome.failure is not None:
            worker = next(w for w in self._supervisor.workers if w.rank == outcome.failure.rank)
            raise _failed(outcome.failure, getattr(worker, "began", True))
        return True

    def _stop(self) -> None:
        self._ended = True
        self._supervisor.stop()
        shutil.rmtree(self._heartbeat_dir, ignore_errors=True)


def _failed(failure: Failure, began: bool = True) -> WorkerFailedError:
    where = f"fleet.spawn: process {failure.rank} (pid {failure.pid})"
    tb = failure.error
    message = (f"{where} raised an exception; the other processes were stopped. "
               f"Its traceback:\n\n{tb}" if tb else
               f"{where} {failure.how}; the other processes were stopped")
    if not began and failure.returncode is not None:
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        message += (" (it ended before it called the function: it failed while starting, "
                    "e.g. in the import of the main script"
                    f"{f' {main}' if main else ''} that spawn runs again in each process; "
                    "its own stderr, above, says why)")
    return WorkerFailedError(message, rank=failure.rank, exitcode=failure.exit_code,
                             worker_traceback=tb)


class SpawnedWorker(Worker):
    """A worker of ``fleet.spawn``: a ``multiprocessing`` child that sends ``("began",
    None)`` once it runs, then ``("ok", value)`` or ``("error", traceback)`` over a
    pipe before it ends."""

    def __init__(self, spec: WorkerSpec, process: Any, reader: Any, results: list[Any]):
        super().__init__(spec, process.pid)
        self.process, self._reader, self._results = process, reader, results
        self.began = False  # the child said it runs _child_main (its start went well)

    def _wait_for_exit(self) -> int:
        sentinel = self.process.sentinel
        while not self._reader.closed:  # read as it comes: a big result fills the pipe
            if sentinel in multiprocessing.connection.wait([self._reader, sentinel]):
                break
            self._receive()
        self._receive()
        self.process.join()
        return self.process.exitcode

    def _receive(self) -> None:
        reader = self._reader
        while not reader.closed:
            try:
                if not reader.poll(0):
                    return
                kind, value = reader.recv()
            except (EOFError, OSError):
                reader.close()
                return
            if kind == "began":
                self.began = True
            elif kind == "ok":
                self._results[self.spec.local_rank] = value
            else:
                self.error = value


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
    with contextlib.suppress(Exception):
        conn.send(("began", None))
    try:
        result = func(*args)
        _heartbeat.mark_finished()
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
