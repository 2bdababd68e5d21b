"""Jobs started by a cluster's own launcher: SLURM's ``srun``, Open MPI's ``mpirun``.

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
from collections.abc import Mapping

from fleet._errors import FleetConfigError

_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
          "SLURM_LOCALID")
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    """This process's place in a job a cluster's launcher started."""

    name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value in (None, ""):
        if default is None:
            raise FleetConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise FleetConfigError(
            f"environment variable {name}={value!r} is not an integer; it is set by the "
            "cluster's launcher: unset it, or start the job with fleetrun"
        ) from None


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


def detect(environ: Mapping[str, str]) -> ClusterJob | None:
    """The SLURM or Open MPI job this process belongs to, as JAX would detect it."""
    if all(name in environ for name in _SLURM):
        size = _int(environ, "SLURM_NTASKS")
        node = _int(environ, "SLURM_NODEID", 0)
        nnodes = _int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", 1))
        local = _slurm_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE"), node)
        return ClusterJob("SLURM", rank=_int(environ, "SLURM_PROCID"), world_size=size,
                          local_rank=_int(environ, "SLURM_LOCALID"),
                          local_world_size=local or max(1, size // max(nnodes, 1)),
                          node_rank=node, nnodes=nnodes)
    if _OMPI_URI in environ:
        size = _int(environ, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
        return ClusterJob("Open MPI", rank=_int(environ, "OMPI_COMM_WORLD_RANK"),
                          world_size=size,
                          local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                          local_world_size=local_size,
                          node_rank=_int(environ, "OMPI_COMM_WORLD_NODE_RANK", 0),
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
