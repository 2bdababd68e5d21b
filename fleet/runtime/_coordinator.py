"""Before a worker joins: does anything answer at the coordinator's address?

Process 0 of a job starts JAX's coordinator (inside ``jax.distributed.initialize``);
every other process connects to it. When nothing ever listens there, JAX's client
retries for its whole ``initialization_timeout`` (300 s by default), then aborts the
process from C++ (an abseil ``FATAL``: ``DEADLINE_EXCEEDED ... RegisterTask``, a C++
stack, exit code 134) with no word of where the address came from. That is what a
*stale environment* does: a shell that still exports an earlier job's
``FLEET_RANK=1``, ``FLEET_COORDINATOR=...`` (or Paddle's names), where no job runs.

So a process other than process 0 first knocks at the address with a plain TCP
connect (:func:`wait_for_coordinator`): a closed port refuses at once, an
unreachable host times out after :data:`PROBE_SECONDS`. It knocks again every
:data:`RETRY_SECONDS` until something answers or the join timeout ends (JAX's
``initialization_timeout``: ``FLEET_JAX_INIT_TIMEOUT``, else JAX's default), since
in a healthy job process 0 may start its coordinator a few seconds after the others
start. After :data:`NOTE_AFTER` seconds it says on stderr what it waits for; at the
timeout it raises a :class:`fleet.FleetConfigError` naming the address, the
variables it came from and what to do. Process 0 never knocks: it is the one that
listens. A job started by a cluster's own launcher (``srun``, ``mpirun``) is left
to JAX, which finds the address itself.

The knock is a TCP handshake that sends nothing; the coordinator's gRPC server
drops such a connection. Once the port answers, JAX's own join (and its timeout)
goes on as before.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

import jax

from fleet._errors import FleetConfigError
from fleet.runtime import _heartbeat
from fleet.runtime._env import WorkerEnv, coordinator_source

PROBE_SECONDS = 2.0  # one connect attempt at most (a host that drops packets)
RETRY_SECONDS = 0.25  # between attempts (a refused port answers at once)
NOTE_AFTER = 10.0  # first "waiting for the coordinator" line on stderr, then every 30 s
NOTE_EVERY = 30.0
INIT_TIMEOUT_VARIABLE = "FLEET_JAX_INIT_TIMEOUT"


def _jax_default_timeout() -> float:
    """``jax.distributed.initialize``'s own ``initialization_timeout`` default (300 s)."""
    parameter = inspect.signature(jax.distributed.initialize).parameters.get(
        "initialization_timeout")
    default = None if parameter is None else parameter.default
    return float(default) if isinstance(default, (int, float)) else 300.0


JAX_INIT_TIMEOUT = _jax_default_timeout()


def _split(address: str, source: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FleetConfigError(
            f"environment variable {source}={address!r} is not the coordinator's host:port "
            "(e.g. 127.0.0.1:6070); it is set by the launcher (fleetrun / fleet.spawn): "
            "unset it or give host:port"
        )
    return host.strip("[]"), int(port)


def _knock(host: str, port: int, seconds: float) -> OSError | None:
    """One TCP connect to ``host:port``: ``None`` if it was accepted, else the error."""
    try:
        with socket.create_connection((host, port), timeout=seconds):
            return None
    except OSError as e:
        return e


def _why(error: OSError | None) -> str:
    if isinstance(error, socket.gaierror):
        return f"the host name does not resolve: {error.strerror or error}"
    if isinstance(error, (TimeoutError, socket.timeout)):
        return f"no answer within {PROBE_SECONDS:g} s a try"
    return (error.strerror or str(error)).lower() if error is not None else "no answer"


def _unreached(env: WorkerEnv, source: str, timeout: float, error: OSError | None,
               environ: Mapping[str, str]) -> FleetConfigError:
    where = (f"rank {env.rank} of {env.world_size}: nothing answers at the coordinator's "
             f"address {env.coordinator} ({source}, from the environment) after {timeout:g} s "
             f"({INIT_TIMEOUT_VARIABLE}; last try: {_why(error)})")
    heartbeat = environ.get(_heartbeat.ENV, "")
    if heartbeat and os.path.isdir(os.path.dirname(heartbeat)):  # a launcher runs this job
        return FleetConfigError(
            f"{where}. Process 0 of the job starts the coordinator there: it failed, or is "
            "stopped, before it did; its log (workerlog.0 under fleetrun's --log_dir) says "
            f"why. A slow start needs a longer {INIT_TIMEOUT_VARIABLE} (seconds)"
        )
    return FleetConfigError(
        f"{where}. Process 0 of a job starts the coordinator, and no fleetrun or "
        "fleet.spawn job started this process: is this a stale environment from an "
        "earlier job? Unset the job's variables to train alone (unset $(env | grep -oE "
        "'^(FLEET|PADDLE)_[A-Z_]+')), or start the job through fleetrun / fleet.spawn, "
        "which set them for every process; if process 0 is started by hand, start it "
        f"too (it listens at {env.coordinator})"
    )


def wait_for_coordinator(env: WorkerEnv, timeout: float,
                         environ: Mapping[str, str] | None = None,
                         note: Callable[[str], None] | None = None) -> float:
    """Waits until the coordinator's address answers (see the module); returns the
    seconds waited. Process 0, and a job a cluster's launcher started, return at once.

    Raises:
        fleet.FleetConfigError: nothing answered within ``timeout`` seconds; the
            message names the address, the variables it came from, what to do.
    """
    if env.rank == 0 or env.from_cluster or not env.coordinator:
        return 0.0
    environ = os.environ if environ is None else environ
    note = note or (lambda text: print(text, file=sys.stderr, flush=True))
    source = coordinator_source(environ)
    host, port = _split(env.coordinator, source)
    start = time.monotonic()
    deadline, next_note = start + timeout, start + NOTE_AFTER
    while True:
        left = deadline - time.monotonic()
        error = _knock(host, port, max(0.05, min(PROBE_SECONDS, left)))
        now = time.monotonic()
        if error is None:
            return now - start
        if now >= deadline:
            raise _unreached(env, source, timeout, error, environ)
        if now >= next_note:
            note(f"fleet: rank {env.rank} waits for the coordinator at {env.coordinator} "
                 f"({source}): {_why(error)}; {now - start:.0f} s of {timeout:g} s "
                 f"({INIT_TIMEOUT_VARIABLE})")
            next_note += NOTE_EVERY
        time.sleep(min(RETRY_SECONDS, max(0.0, deadline - now)))
