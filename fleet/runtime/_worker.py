"""The worker's side of the launcher contract.

A launcher (``fleetrun``, ``python -m fleet.launch``, ``fleet.spawn``, or a
cluster's own: SLURM's ``srun``, Open MPI's ``mpirun``) starts the workers; each
worker, in this module:

* joins the job's distributed runtime (:func:`initialize_distributed`, called by
  ``fleet.init``; :func:`join_launched_job`, called by ``import fleet``);
* tells the launcher's watchdog it is making progress and how it ended
  (:mod:`fleet.runtime._heartbeat`, the heartbeat file's one home);
* leaves at once when it fails (:func:`install_fail_fast`) instead of waiting
  for its peers in JAX's shutdown barrier.

This module is part of the core: it imports nothing from ``fleet.launch``.
"""

from __future__ import annotations

import atexit
import os
import sys

import jax

from fleet import _compat
from fleet._errors import FleetConfigError
from fleet.runtime import _agree, _coordinator
from fleet.runtime._env import WorkerEnv, alone_note, number
from fleet.runtime._heartbeat import mark_failed, mark_finished

# -- fail fast ---------------------------------------------------------------------
#
# At interpreter exit JAX's distributed client waits in a shutdown barrier for
# every other process. A worker that raised, or called sys.exit(non-zero), while
# its peers wait for it inside a collective would wait there for them, and they
# for it: the launcher would never see it fail. In a multi-process job the
# worker therefore ends with os._exit(code) before that barrier when the program
# failed: an uncaught exception (already printed by then), or an exit status
# that fleetrun's runner (fleet/launch/_run.py) saw the script end with. A
# successful exit still shuts down cleanly. A worker started some other way
# (srun, mpirun) without that runner fails fast on an uncaught exception; its
# sys.exit(non-zero) is ended by JAX's own shutdown timeout.

_exit_state: dict[str, object] = {}


def note_exit(status: object) -> None:
    """How the training script ended (``sys.exit``'s argument; 1 for an exception):
    told by fleetrun's runner, read by the exit hook below. A failure is marked in
    the heartbeat file at once, with its time: the launcher names the worker that
    failed first, not a peer that failed because it went."""
    _exit_state["status"] = status
    if _exit_code(status):
        mark_failed()


def _exit_code(status: object) -> int:
    if status is None:
        return 0
    if isinstance(status, bool) or not isinstance(status, int):
        return 1  # sys.exit("message") prints the message and exits 1
    return status & 0xFF


def _at_exit() -> None:
    code = _exit_code(_exit_state.get("status"))
    last = getattr(sys, "last_value", None)  # set when an uncaught exception was printed
    if not code and last is not None and not isinstance(last, (SystemExit, KeyboardInterrupt)):
        code = 1
    if isinstance(last, KeyboardInterrupt):
        code = 130
    if not code:
        mark_finished()
        return
    mark_failed()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed stream)
            pass
    _agree.exit_together()  # (an error every process raises: each one's is printed first)
    os._exit(code)


def install_fail_fast() -> None:
    """Makes a failing worker exit at once (see above). Idempotent."""
    if "installed" in _exit_state:
        return
    _exit_state["installed"] = True
    atexit.register(_at_exit)  # atexit runs last-in first-out: before JAX's own clean-up


# -- joining the distributed runtime ----------------------------------------------


_alone_noted: list[bool] = []

# The process that joins a job marks itself in its environment; the processes it
# starts inherit the mark and stay out of the job: a DataLoader's workers, a
# multiprocessing or subprocess child that imports fleet. Such a child carries the
# worker's FLEET_* variables, and joining with its parent's rank would abort the
# whole job ("tried to connect with a different incarnation").
WORKER_PID = "FLEET_WORKER_PID"


# The address this worker's gloo listeners bind and advertise, chosen by fleetrun:
# loopback on one node, the node's address that reaches the master on several (gloo
# would take what the hostname resolves to: a loopback address on Debian's default
# /etc/hosts, which breaks a multi-node job, or a public one, which exposes a
# single-node job).
GLOO_ADDRESS = "FLEET_GLOO_ADDRESS"


def started_by_a_worker() -> int | None:
    """The pid of the job's worker that started this process (``None``: it did not)."""
    pid = os.environ.get(WORKER_PID, "")
    if not pid.isdigit() or int(pid) == os.getpid():
        return None
    return int(pid)


def _wait_for_coordinator(env: WorkerEnv, kwargs: dict) -> None:
    """Waits until the coordinator answers (fleet.runtime._coordinator); what it
    waited comes off JAX's join timeout, so the join has one timeout in all."""
    timeout = kwargs.get("initialization_timeout", _coordinator.JAX_INIT_TIMEOUT)
    waited = _coordinator.wait_for_coordinator(env, timeout)
    if waited >= 1:
        kwargs["initialization_timeout"] = max(1, int(timeout - waited))


def _refuse_a_workers_child(env: WorkerEnv) -> None:
    """Refuses to join a job from a process that one of its workers started (see
    ``WORKER_PID``) while the job's variables would make it join."""
    parent = started_by_a_worker()
    if parent is not None and (env.is_multiprocess or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        raise FleetConfigError(
            f"this process (pid {os.getpid()}) was started by process {env.rank} of the job "
            f"(pid {parent}); only the processes the launcher started join the job. Give a "
            "child process its own job (fleetrun, fleet.spawn), or let it train alone: "
            f"remove the FLEET_* and PADDLE_* variables (and {WORKER_PID}) from its "
            "environment"
        )


def _add_launcher_timeouts(kwargs: dict) -> None:
    """Adds the launcher's timeouts to ``jax.distributed.initialize``'s ``kwargs``
    (fleet/launch/_main.py documents them): JAX's heartbeat must outlast fleet's
    own stuck-worker watchdog."""
    for variable, argument in (("FLEET_JAX_HEARTBEAT_TIMEOUT", "heartbeat_timeout_seconds"),
                               ("FLEET_JAX_INIT_TIMEOUT", "initialization_timeout")):
        seconds = number(os.environ, variable, parse=lambda v: int(float(v)),
                         what="a number of seconds")
        if seconds is not None:
            kwargs[argument] = seconds


def initialize_distributed(env: WorkerEnv) -> None:
    """Joins the job's distributed runtime (``jax.distributed.initialize``) if any.

    A job started by fleet's launcher (or any that sets ``FLEET_*`` / ``PADDLE_*``)
    joins with its explicit coordinator, rank and size; one started by SLURM's
    ``srun`` or Open MPI's ``mpirun``, or one that sets ``JAX_COORDINATOR_ADDRESS``,
    joins through JAX's own cluster detection (``jax.distributed.initialize()``
    with no arguments). A process with no job variables trains alone and says so
    once, on stderr.
    """
    if jax.distributed.is_initialized():
        return
    _refuse_a_workers_child(env)
    if env.is_multiprocess and not env.from_cluster:
        kwargs = dict(
            coordinator_address=env.coordinator,
            num_processes=env.world_size,
            process_id=env.rank,
        )
    elif env.is_multiprocess or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        kwargs = {}  # JAX reads its own variables and detects the cluster.
    else:
        note = alone_note(os.environ) if env.launcher is None else None
        if note and not _alone_noted:
            _alone_noted.append(True)
            print(f"fleet: training alone in one process ({note})", file=sys.stderr,
                  flush=True)
        return
    _add_launcher_timeouts(kwargs)
    if _compat.backends_are_initialized():  # JAX joins a job only before it computes
        raise FleetConfigError(
            "fleet.init must run before any JAX computation in a multi-process job (this "
            f"process, rank {env.rank} of {env.world_size}, has computed already); move "
            "fleet.init(is_collective=True) to the top of your script"
        )
    if "coordinator_address" in kwargs:  # a stale address must not end in JAX's C++ abort
        _wait_for_coordinator(env, kwargs)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    install_fail_fast()  # a failing worker must not wait in JAX's shutdown barrier
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as e:  # JAX found no cluster: no process count, no rank
        if env.is_multiprocess:
            raise
        raise FleetConfigError(
            f"JAX_COORDINATOR_ADDRESS={os.environ.get('JAX_COORDINATOR_ADDRESS')!r} is set "
            f"but JAX cannot tell this process's rank and the job's size ({e}); start the "
            "job with fleetrun, or set FLEET_RANK and FLEET_WORLD_SIZE too"
        ) from e
    os.environ[WORKER_PID] = str(os.getpid())  # its children stay out (see WORKER_PID)
    gloo_address = os.environ.get(GLOO_ADDRESS)
    if gloo_address and not env.from_cluster:
        _compat.bind_cpu_collectives(gloo_address)
    if env.from_cluster and (jax.process_count(), jax.process_index()) != (
            env.world_size, env.rank):
        raise FleetConfigError(
            f"{env.launcher} says this is process {env.rank} of {env.world_size}, but JAX "
            f"joined it as process {jax.process_index()} of {jax.process_count()}"
        )


def join_launched_job() -> None:
    """Joins the job's distributed runtime now if a launcher started this process.

    ``import fleet`` calls it. JAX allows ``jax.distributed.initialize`` only before
    its first computation, and a ``fleet.Model`` script builds its network (which
    computes) with no ``fleet.init`` at all: the launcher alone makes it distributed,
    as with Paddle's high-level API. Outside a launched multi-process job it does
    nothing, and so it does in a process that a worker started (a DataLoader's
    workers, any child: see ``WORKER_PID``); a malformed environment or a backend
    already running is left for ``fleet.init`` to report.
    """
    if started_by_a_worker() is not None:
        return
    try:
        env = WorkerEnv.from_environ()
    except FleetConfigError:
        return
    if not env.is_multiprocess or jax.distributed.is_initialized():
        return
    if _compat.backends_are_initialized():
        return
    initialize_distributed(env)
