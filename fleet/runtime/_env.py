"""The worker environment: what a launcher tells each process about its job.

A launcher (``fleetrun``, ``python -m fleet.launch``, ``fleet.spawn``) sets these
variables for every worker; ``fleet.init`` reads them. fleet's own names come
first; Paddle's names are set too (and read as a fallback) so that ported
scripts that read them keep working.

==========================  ==========================  ===========================================
fleet name                  Paddle name                 meaning
==========================  ==========================  ===========================================
``FLEET_RANK``              ``PADDLE_TRAINER_ID``       global index of this process (0-based)
``FLEET_WORLD_SIZE``        ``PADDLE_TRAINERS_NUM``     number of processes in the job
``FLEET_LOCAL_RANK``        --                          index of this process on its node
``FLEET_LOCAL_WORLD_SIZE``  --                          number of processes on this node
``FLEET_NODE_RANK``         --                          index of this node
``FLEET_NNODES``            --                          number of nodes
``FLEET_COORDINATOR``       --                          ``host:port`` of JAX's coordinator (rank 0)
``FLEET_CURRENT_ENDPOINT``  ``PADDLE_CURRENT_ENDPOINT`` ``host:port`` of this worker
``FLEET_TRAINER_ENDPOINTS`` ``PADDLE_TRAINER_ENDPOINTS`` all workers' endpoints, comma-separated
``FLEET_RESTART_COUNT``     --                          how often the launcher restarted the job
``FLEET_JOB_ID``            --                          the launcher's job id
==========================  ==========================  ===========================================

Paddle 3's launcher's names are set too, with its meanings: ``PADDLE_GLOBAL_RANK``
(= ``FLEET_RANK``), ``PADDLE_GLOBAL_SIZE`` (= ``FLEET_WORLD_SIZE``),
``PADDLE_LOCAL_RANK`` and ``PADDLE_RANK_IN_NODE`` (= ``FLEET_LOCAL_RANK``),
``PADDLE_LOCAL_SIZE`` (= ``FLEET_LOCAL_WORLD_SIZE``), ``PADDLE_NNODES``,
``PADDLE_MASTER`` (rank 0's ``host:port``) and, from ``fleetrun``,
``PADDLE_LOG_DIR`` (the absolute ``--log_dir``).

When ``FLEET_COORDINATOR`` is missing, the first of the trainer endpoints is the
coordinator (Paddle's launcher gives only endpoints).

Without any of these, a process started by a cluster's own launcher (SLURM's
``srun``, Open MPI's ``mpirun``) takes its place from that launcher's variables
(``fleet/runtime/_cluster.py``); ``fleet.init`` then lets JAX find the coordinator. A
process that is one of several but cannot join them (``fleet.runtime._cluster.unjoinable``)
is refused: it would train alone.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from fleet._errors import FleetConfigError
from fleet.runtime import _cluster

# fleet name -> Paddle name (read as a fallback, and written by the launchers).
PADDLE_ALIASES = {
    "FLEET_RANK": "PADDLE_TRAINER_ID",
    "FLEET_WORLD_SIZE": "PADDLE_TRAINERS_NUM",
    "FLEET_CURRENT_ENDPOINT": "PADDLE_CURRENT_ENDPOINT",
    "FLEET_TRAINER_ENDPOINTS": "PADDLE_TRAINER_ENDPOINTS",
}


def _lookup(environ: Mapping[str, str], name: str) -> tuple[str, str | None]:
    """``(variable, value)``: fleet's ``name``, or its Paddle alias where ``name`` is
    unset or empty (the variable named is the one the value came from)."""
    value = environ.get(name)
    if value in (None, "") and name in PADDLE_ALIASES:
        alias = PADDLE_ALIASES[name]
        if environ.get(alias):
            return alias, environ[alias]
    return name, value or None


def coordinator_source(environ: Mapping[str, str] | None = None) -> str:
    """The variable(s) the coordinator's address was read from, as
    :meth:`WorkerEnv.from_environ` reads it: ``FLEET_COORDINATOR``, else the first
    of the trainer endpoints (and ``PADDLE_MASTER`` where it says the same)."""
    environ = os.environ if environ is None else environ
    name, value = _lookup(environ, "FLEET_COORDINATOR")
    if value is None:
        name, value = _lookup(environ, "FLEET_TRAINER_ENDPOINTS")
        value = (value or "").split(",")[0]
    names = [name]
    if environ.get("PADDLE_MASTER") and environ["PADDLE_MASTER"] == value:
        names.insert(0, "PADDLE_MASTER")
    return " / ".join(names)


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """This process's place in the job, as its launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    coordinator: str | None = None
    current_endpoint: str | None = None
    trainer_endpoints: tuple[str, ...] = ()
    restart_count: int = 0
    job_id: str | None = None
    launcher: str | None = None  # "fleet" (FLEET_* / PADDLE_*), "SLURM", "Open MPI", None

    @property
    def is_multiprocess(self) -> bool:
        return self.world_size > 1

    @property
    def from_cluster(self) -> bool:
        """Started by a cluster's launcher: JAX's own detection finds the coordinator."""
        return self.launcher not in (None, "fleet")

    def to_environ(self) -> dict[str, str]:
        """The variables a launcher sets for this worker (fleet's and Paddle's names)."""
        env = {
            "FLEET_RANK": str(self.rank),
            "FLEET_WORLD_SIZE": str(self.world_size),
            "FLEET_LOCAL_RANK": str(self.local_rank),
            "FLEET_LOCAL_WORLD_SIZE": str(self.local_world_size),
            "FLEET_NODE_RANK": str(self.node_rank),
            "FLEET_NNODES": str(self.nnodes),
            "FLEET_RESTART_COUNT": str(self.restart_count),
        }
        if self.coordinator:
            env["FLEET_COORDINATOR"] = self.coordinator
        if self.current_endpoint:
            env["FLEET_CURRENT_ENDPOINT"] = self.current_endpoint
        if self.trainer_endpoints:
            env["FLEET_TRAINER_ENDPOINTS"] = ",".join(self.trainer_endpoints)
        if self.job_id:
            env["FLEET_JOB_ID"] = self.job_id
        for fleet_name, paddle_name in PADDLE_ALIASES.items():
            if fleet_name in env:
                env[paddle_name] = env[fleet_name]
        env.update({  # Paddle 3's launcher's names, with its meanings
            "PADDLE_GLOBAL_RANK": str(self.rank),
            "PADDLE_GLOBAL_SIZE": str(self.world_size),
            "PADDLE_LOCAL_RANK": str(self.local_rank),
            "PADDLE_RANK_IN_NODE": str(self.local_rank),
            "PADDLE_LOCAL_SIZE": str(self.local_world_size),
            "PADDLE_NNODES": str(self.nnodes),
        })
        master = self.coordinator or (self.trainer_endpoints[0] if self.trainer_endpoints
                                      else None)
        if master:
            env["PADDLE_MASTER"] = master
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Reads the variables above; a process without them is a one-process job."""
        environ = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return _lookup(environ, name)[1]

        def get_int(name: str, default: int) -> int:
            source, value = _lookup(environ, name)
            if value is None:
                return default
            try:
                return int(value)
            except ValueError:
                also = f" (Paddle's name for {name})" if source != name else ""
                raise FleetConfigError(
                    f"environment variable {source}={value!r}{also} is not an integer; "
                    "it is set by the launcher (fleetrun / fleet.spawn): unset it or "
                    "give an integer"
                ) from None

        endpoints_text = get("FLEET_TRAINER_ENDPOINTS")
        endpoints = tuple(e for e in (endpoints_text or "").split(",") if e)
        launched = any(get(name) is not None for name in
                       ("FLEET_RANK", "FLEET_WORLD_SIZE", "FLEET_COORDINATOR"))
        if not launched and not endpoints and not environ.get("JAX_COORDINATOR_ADDRESS"):
            cluster = _cluster.detect(environ)
            if cluster is not None:
                env = cls(rank=cluster.rank, world_size=cluster.world_size,
                          local_rank=cluster.local_rank,
                          local_world_size=cluster.local_world_size,
                          node_rank=cluster.node_rank, nnodes=cluster.nnodes,
                          launcher=cluster.name)
                env.validate()
                return env
            reason = _cluster.unjoinable(environ)
            if reason is not None:
                raise FleetConfigError(
                    f"{reason}, but fleet cannot join them (it would train alone). Start "
                    "the job with fleetrun, with srun, or with Open MPI 4's mpirun; or set "
                    "FLEET_RANK, FLEET_WORLD_SIZE and FLEET_COORDINATOR=host:port (rank "
                    "0's address) for every process"
                )
        world_size = get_int("FLEET_WORLD_SIZE", len(endpoints) or 1)
        env = cls(
            rank=get_int("FLEET_RANK", 0),
            world_size=world_size,
            local_rank=get_int("FLEET_LOCAL_RANK", 0),
            local_world_size=get_int("FLEET_LOCAL_WORLD_SIZE", 1),
            node_rank=get_int("FLEET_NODE_RANK", 0),
            nnodes=get_int("FLEET_NNODES", 1),
            coordinator=get("FLEET_COORDINATOR") or (endpoints[0] if endpoints else None),
            current_endpoint=get("FLEET_CURRENT_ENDPOINT"),
            trainer_endpoints=endpoints,
            restart_count=get_int("FLEET_RESTART_COUNT", 0),
            job_id=get("FLEET_JOB_ID"),
            launcher="fleet" if launched or endpoints else None,
        )
        env.validate()
        return env

    def validate(self) -> None:
        if self.world_size < 1:
            raise FleetConfigError(f"world size {self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise FleetConfigError(
                f"rank {self.rank} is outside the job's {self.world_size} processes "
                f"(allowed: 0..{self.world_size - 1}); check FLEET_RANK / PADDLE_TRAINER_ID"
            )
        if self.is_multiprocess and not self.coordinator and not self.from_cluster:
            raise FleetConfigError(
                f"a {self.world_size}-process job needs a coordinator address: set "
                "FLEET_COORDINATOR=host:port (or PADDLE_TRAINER_ENDPOINTS), or start the "
                "job with fleetrun / fleet.spawn, which set it"
            )
