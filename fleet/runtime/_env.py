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

Paddle 3's launcher's names are set too, with its meanings (:data:`PADDLE3_NAMES`),
``PADDLE_MASTER`` (rank 0's ``host:port``) and, from ``fleetrun``, ``PADDLE_LOG_DIR``
(the absolute ``--log_dir``).

When ``FLEET_COORDINATOR`` is missing, the first of the trainer endpoints is the
coordinator (Paddle's launcher gives only endpoints).

Jobs started by a cluster's own launcher (SLURM's ``srun``, Open MPI's ``mpirun``)
-----------------------------------------------------------------------------------

``srun -n 4 python train.py`` starts four copies of the script with no ``FLEET_*``
variables. fleet reads the variables JAX's own cluster detection reads
(JAX's ``clusters`` package, beside ``jax.distributed``) to know this process's place in the job, and
``fleet.init`` joins the job with ``jax.distributed.initialize()`` with no
arguments, so JAX finds the coordinator exactly as it would alone:

===========  ==========================================================  ==========================
cluster      present when (JAX's test)                                   rank / size / local rank
===========  ==========================================================  ==========================
SLURM        ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,   ``SLURM_PROCID`` /
             ``SLURM_PROCID``, ``SLURM_LOCALID`` (set by ``srun``)         ``SLURM_NTASKS`` /
                                                                         ``SLURM_LOCALID``
Open MPI     ``OMPI_MCA_orte_hnp_uri`` (``mpirun`` of Open MPI 4 and       ``OMPI_COMM_WORLD_RANK`` /
             earlier)                                                     ``_SIZE`` / ``_LOCAL_RANK``
===========  ==========================================================  ==========================

The coordinator is the first node of the step (SLURM) or ``mpirun``'s host (Open
MPI), on a port JAX derives from the job id; ``JAX_COORDINATOR_PORT`` overrides
the port. JAX gives each process the GPU of its local rank (its convention: one
task per GPU, e.g. ``srun --ntasks-per-node=8`` on 8-GPU nodes). Kubernetes
(JAX's third detector) needs API calls to tell the job's size: set
``JAX_COORDINATOR_ADDRESS`` there, and JAX fills in the rest.

Some launchers say that a process is one of several but give JAX no way to join
the others (Open MPI 5's ``prterun``, MPICH's and Intel MPI's ``hydra``, torchrun).
:func:`unjoinable` names them; ``fleet.init`` raises there rather than train
alone.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from fleet._errors import FleetConfigError

# fleet name -> Paddle name (read as a fallback, and written by the launchers).
PADDLE_ALIASES = {
    "FLEET_RANK": "PADDLE_TRAINER_ID",
    "FLEET_WORLD_SIZE": "PADDLE_TRAINERS_NUM",
    "FLEET_CURRENT_ENDPOINT": "PADDLE_CURRENT_ENDPOINT",
    "FLEET_TRAINER_ENDPOINTS": "PADDLE_TRAINER_ENDPOINTS",
}
# Paddle 3's launcher's name -> the fleet name whose value it has.
PADDLE3_NAMES = {
    "PADDLE_GLOBAL_RANK": "FLEET_RANK",
    "PADDLE_GLOBAL_SIZE": "FLEET_WORLD_SIZE",
    "PADDLE_LOCAL_RANK": "FLEET_LOCAL_RANK",
    "PADDLE_RANK_IN_NODE": "FLEET_LOCAL_RANK",
    "PADDLE_LOCAL_SIZE": "FLEET_LOCAL_WORLD_SIZE",
    "PADDLE_NNODES": "FLEET_NNODES",
}
# WorkerEnv's integer fields -> their variables.
_INT_VARIABLES = {
    "rank": "FLEET_RANK",
    "world_size": "FLEET_WORLD_SIZE",
    "local_rank": "FLEET_LOCAL_RANK",
    "local_world_size": "FLEET_LOCAL_WORLD_SIZE",
    "node_rank": "FLEET_NODE_RANK",
    "nnodes": "FLEET_NNODES",
    "restart_count": "FLEET_RESTART_COUNT",
}
_FROM_LAUNCHER = "; it is set by the launcher (fleetrun / fleet.spawn): unset it or give an integer"
_FROM_CLUSTER = ("; it is set by the cluster's launcher: unset it, or start the job with "
                 "fleetrun")


def _lookup(environ: Mapping[str, str], name: str) -> tuple[str, str | None]:
    """``(variable, value)``: fleet's ``name``, or its Paddle alias where ``name`` is
    unset or empty (the variable named is the one the value came from)."""
    value = environ.get(name)
    if value in (None, "") and name in PADDLE_ALIASES:
        alias = PADDLE_ALIASES[name]
        if environ.get(alias):
            return alias, environ[alias]
    return name, value or None


def number(environ: Mapping[str, str], name: str, default: Any = None, *,
           parse: Callable[[str], Any] = int, what: str = "an integer", then: str = "",
           required: bool = False) -> Any:
    """fleet's one reader of a numeric variable: ``name`` (or its Paddle alias)
    parsed by ``parse``; ``default`` where it is unset or empty (an error if
    ``required``). A value ``parse`` refuses raises, naming the variable as it was
    set, ``what`` it must be and ``then`` what to do."""
    source, value = _lookup(environ, name)
    if value is None:
        if required:
            raise FleetConfigError(f"environment variable {name} is not set")
        return default
    try:
        return parse(value)
    except ValueError:
        also = f" (Paddle's name for {name})" if source != name else ""
        raise FleetConfigError(
            f"environment variable {source}={value!r}{also} is not {what}{then}") from None


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
        env = {variable: str(getattr(self, field)) for field, variable in _INT_VARIABLES.items()}
        strings = {"FLEET_COORDINATOR": self.coordinator,
                   "FLEET_CURRENT_ENDPOINT": self.current_endpoint,
                   "FLEET_TRAINER_ENDPOINTS": ",".join(self.trainer_endpoints),
                   "FLEET_JOB_ID": self.job_id}
        env.update({variable: value for variable, value in strings.items() if value})
        env.update({paddle: env[fleet] for fleet, paddle in PADDLE_ALIASES.items() if fleet in env})
        env.update({paddle: env[fleet] for paddle, fleet in PADDLE3_NAMES.items()})
        master = self.coordinator or (self.trainer_endpoints[0] if self.trainer_endpoints
                                      else None)
        if master:
            env["PADDLE_MASTER"] = master
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Reads the variables above; a process without them is a one-process job."""
        environ = os.environ if environ is None else environ
        endpoints_text = _lookup(environ, "FLEET_TRAINER_ENDPOINTS")[1]
        endpoints = tuple(e for e in (endpoints_text or "").split(",") if e)
        launched = any(_lookup(environ, name)[1] is not None for name in
                       ("FLEET_RANK", "FLEET_WORLD_SIZE", "FLEET_COORDINATOR"))
        if not launched and not endpoints and not environ.get("JAX_COORDINATOR_ADDRESS"):
            cluster = _cluster_job(environ)
            if cluster is not None:
                env = cls(**cluster)
                env.validate()
                return env
            reason = unjoinable(environ)
            if reason is not None:
                raise FleetConfigError(
                    f"{reason}, but fleet cannot join them (it would train alone). Start "
                    "the job with fleetrun, with srun, or with Open MPI 4's mpirun; or set "
                    "FLEET_RANK, FLEET_WORLD_SIZE and FLEET_COORDINATOR=host:port (rank "
                    "0's address) for every process"
                )
        defaults = {"world_size": len(endpoints) or 1}
        ints = {field: number(environ, variable, defaults.get(field, getattr(cls, field)),
                              then=_FROM_LAUNCHER)
                for field, variable in _INT_VARIABLES.items()}
        env = cls(
            **ints,
            coordinator=(_lookup(environ, "FLEET_COORDINATOR")[1]
                         or (endpoints[0] if endpoints else None)),
            current_endpoint=_lookup(environ, "FLEET_CURRENT_ENDPOINT")[1],
            trainer_endpoints=endpoints,
            job_id=_lookup(environ, "FLEET_JOB_ID")[1],
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


# -- a cluster's own launcher ---------------------------------------------------------

_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
          "SLURM_LOCALID")
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"


def _slurm_tasks_per_node(text: str | None, node: int) -> int | None:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) -> the count on node ``node``."""
    if not text:
        return None
    counts: list[int] = []
    try:
        for part in text.split(","):
            count, _, repeat = part.partition("(x")
            counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    except ValueError:
        return None
    return counts[node] if 0 <= node < len(counts) else None


def _cluster_job(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The :class:`WorkerEnv` fields of the SLURM or Open MPI job this process
    belongs to, as JAX would detect it; ``None`` outside such a job."""
    def get(name: str, default: int | None = None) -> int:
        return number(environ, name, default, then=_FROM_CLUSTER, required=default is None)

    if all(name in environ for name in _SLURM):
        size, node = get("SLURM_NTASKS"), get("SLURM_NODEID", 0)
        nnodes = get("SLURM_STEP_NUM_NODES", get("SLURM_NNODES", 1))
        local = _slurm_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE"), node)
        return dict(launcher="SLURM", rank=get("SLURM_PROCID"), world_size=size,
                    local_rank=get("SLURM_LOCALID"),
                    local_world_size=local or max(1, size // max(nnodes, 1)),
                    node_rank=node, nnodes=nnodes)
    if _OMPI_URI in environ:
        size, local_size = get("OMPI_COMM_WORLD_SIZE"), get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)
        return dict(launcher="Open MPI", rank=get("OMPI_COMM_WORLD_RANK"), world_size=size,
                    local_rank=get("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                    local_world_size=local_size,
                    node_rank=get("OMPI_COMM_WORLD_NODE_RANK", 0),
                    nnodes=max(1, size // max(local_size, 1)))
    return None


# Launchers whose variables say "one of N" but that give JAX no coordinator.
_UNJOINABLE = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun/prterun (Open MPI 5 "
     "sets no OMPI_MCA_orte_hnp_uri, so JAX cannot find the coordinator)"),
    ("PMI_SIZE", "PMI_RANK", "an MPI launcher (MPICH / Intel MPI hydra)"),
    ("PMIX_SIZE", "PMIX_RANK", "a PMIx launcher"),
    ("WORLD_SIZE", "RANK", "torchrun or a PyTorch job controller"),
)


def unjoinable(environ: Mapping[str, str]) -> str | None:
    """Why this process is one of several that fleet cannot join, or ``None``."""
    for size_name, rank_name, who in _UNJOINABLE:
        size = environ.get(size_name, "")
        if size.isdigit() and int(size) > 1 and rank_name in environ:
            return (f"{size_name}={size} and {rank_name}={environ[rank_name]} say this "
                    f"process is one of {size}, started by {who}")
    return None


def alone_note(environ: Mapping[str, str]) -> str | None:
    """Why a process with no job variables that looks like one of several trains
    alone (one line), or ``None`` when nothing says it should have company."""
    tasks = environ.get("SLURM_NTASKS", "")
    if "SLURM_JOB_ID" in environ and tasks.isdigit() and int(tasks) > 1:
        return (f"this SLURM allocation has {tasks} tasks, but this process was not started "
                f"by srun: use 'srun python SCRIPT' to start all {tasks}")
    size = environ.get("WORLD_SIZE", "")
    if size.isdigit() and int(size) > 1:
        return (f"WORLD_SIZE={size} (torchrun's variable) says this is one of {size} "
                "processes, but fleet reads FLEET_* / PADDLE_* variables: start the job "
                "with fleetrun")
    return None
