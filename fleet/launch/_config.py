"""The launch configuration (frozen, validated).

``LaunchConfig`` is what the user asked for; :func:`resolve` fills in the
defaults that depend on the machine (GPUs, node rank from ``--ips``) and checks
everything that can be checked before a worker starts; :func:`make_log_dir`
makes ``--log_dir`` and writes to it once. Each worker's environment for one
attempt: ``fleet.launch._worker_plan``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping

from fleet._errors import FleetConfigError
from fleet.checkpoint import _disk
from fleet.launch import _devices, _net
from fleet.launch._watchdog import FIRST_STEP_MIN, SILENCE_WARNING, UNEVEN_GRACE

DEFAULT_PORT = 6070  # Paddle's first port when --ips is given without a port.


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One node's share of a job. ``None`` fields are filled in by :func:`resolve`.

    Every field but the script's is the ``fleetrun`` option of its name (what each
    means: ``fleetrun --help``, from ``OPTIONS`` in ``fleet/launch/_args.py``).

    Attributes:
        training_script: the script every worker runs (``None`` under ``fleet.spawn``).
        training_script_args: its arguments.
        cpu_devices: ``None`` keeps the inherited ``XLA_FLAGS`` / ``JAX_PLATFORMS``.
        master: ``None`` on a single node: loopback and a free port, picked again at
            each restart.
    """

    training_script: str | None = None
    training_script_args: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    gpus: tuple[str, ...] | None = None
    cpu_devices: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master: str | None = None
    ips: tuple[str, ...] | None = None
    node_ip: str | None = None
    started_port: int | None = None
    log_dir: str = "log"
    max_restarts: int = 0
    job_id: str = "default"
    progress_timeout: float = 600.0
    first_step_min: float = FIRST_STEP_MIN
    uneven_grace: float = UNEVEN_GRACE
    silence_warning: float = SILENCE_WARNING
    allow_oversubscribe: bool = False
    verbose_env: bool = False
    join_timeout: float = 300.0  # JAX's own initialization_timeout
    print_config: bool = False

    @property
    def tables(self) -> bool:
        """Whether the launcher prints Paddle's tables (else one line per start)."""
        return self.print_config or self.verbose_env

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def table(self, given: LaunchConfig | None = None) -> dict[str, object]:
        """The configuration table's rows: Paddle launcher's nine first, as the user
        ``given`` them (``gpus: None`` when not given), then fleet's own."""
        given = self if given is None else given
        rows: dict[str, object] = {
            "gpus": _shown(given.gpus),
            "ips": _shown(given.ips) or _net.LOOPBACK,
            "log_dir": given.log_dir,
            "server_num": None,
            "servers": "",
            "training_script": given.training_script,
            "training_script_args": list(given.training_script_args),
            "worker_num": None,
            "workers": "",
        }
        for field in sorted(dataclasses.fields(self), key=lambda f: f.name):
            if field.name not in rows:
                rows[field.name] = _shown(getattr(self, field.name))
        return rows


def _shown(value: object) -> object:
    return ",".join(value) if isinstance(value, tuple) else value


# Each number's bound: whether a value keeps it, and the error's end when not.
_BOUNDS: dict[str, tuple[Callable[[float], bool], str]] = {
    "nproc_per_node": (lambda v: v >= 1, "must be at least 1"),
    "cpu_devices": (lambda v: v >= 1, "must be at least 1"),
    "nnodes": (lambda v: v >= 1, "must be at least 1"),
    "max_restarts": (lambda v: v >= 0, "must be at least 0"),
    "progress_timeout": (lambda v: v >= 0, "must be >= 0 seconds (0 turns the watchdog off)"),
    "silence_warning": (lambda v: v >= 0, "must be >= 0 seconds (0: no warning lines)"),
    "first_step_min": (lambda v: v > 0, "must be > 0 seconds"),
    "uneven_grace": (lambda v: v > 0, "must be > 0 seconds"),
    "join_timeout": (lambda v: v > 0, "must be > 0 seconds"),
}


def resolve(config: LaunchConfig, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Validates ``config`` and fills in machine-dependent defaults.

    Everything that can go wrong before a worker starts fails here with a
    :class:`fleet.FleetConfigError`: a missing script, a taken port, GPU ids that do
    not exist, a node rank outside ``nnodes``, inconsistent options.
    """
    environ = os.environ if environ is None else environ
    _check_values(config)
    gpus, nproc = _processes(config, environ)
    nnodes, node_rank, master = _nodes(config)
    return dataclasses.replace(
        config, nproc_per_node=nproc, gpus=gpus, nnodes=nnodes, node_rank=node_rank,
        master=master,
    )


def _check_values(config: LaunchConfig) -> None:
    """The values that can be checked one by one."""
    for name, (allowed, bound) in _BOUNDS.items():
        value = getattr(config, name)
        if value is not None and not allowed(value):
            raise FleetConfigError(f"--{name} {value} {bound}")
    if config.training_script is not None and not os.path.isfile(config.training_script):
        raise FleetConfigError(
            f"training script {config.training_script!r} does not exist (looked in "
            f"{os.getcwd()}); give the path of a Python file"
        )
    if not config.job_id or "," in config.job_id:
        raise FleetConfigError(f"--job_id {config.job_id!r} must be a non-empty name")
    if os.path.exists(config.log_dir) and not os.path.isdir(config.log_dir):
        raise FleetConfigError(
            f"--log_dir {config.log_dir!r} is a file; the workers' logs (workerlog.N) go in "
            "a directory: give a directory's path (it is created if missing)"
        )


def _processes(config: LaunchConfig,
               environ: Mapping[str, str]) -> tuple[tuple[str, ...] | None, int]:
    """This node's GPUs (``None``: CPU processes) and number of processes."""
    gpus, nproc = config.gpus, config.nproc_per_node
    if gpus is not None and config.cpu_devices is not None:
        raise FleetConfigError(
            "--gpus and --cpu_devices both given; choose GPU processes (--gpus 0,1) or "
            "CPU processes (--cpu_devices N)"
        )
    if gpus is not None:
        if not gpus:
            raise FleetConfigError("--gpus is empty; give GPU ids such as --gpus 0,1")
        _devices.check_gpus(gpus, environ)
        if nproc is not None and nproc != len(gpus):
            raise FleetConfigError(
                f"--nproc_per_node {nproc} does not match --gpus {','.join(gpus)} "
                f"({len(gpus)} GPUs, one process each); drop one of the two options"
            )
        nproc = len(gpus)
    elif config.cpu_devices is None:
        visible = _devices.visible_gpus(environ)
        if visible:
            nproc = nproc or len(visible)
            if nproc > len(visible):
                raise FleetConfigError(
                    f"--nproc_per_node {nproc} needs {nproc} GPUs (one each) but "
                    f"{len(visible)} are visible ({','.join(visible)}); use at most "
                    f"{len(visible)} processes, or --cpu_devices N for CPU processes"
                )
            gpus = tuple(visible[:nproc])
    if gpus is None:
        _devices.check_cpu_processes(nproc or 1, config.allow_oversubscribe)
    return gpus, nproc or 1


def _nodes(config: LaunchConfig) -> tuple[int, int, str | None]:
    """The number of nodes, this node's rank, and the coordinator (``None``: loopback
    and a port picked per attempt); a fixed coordinator's port is checked on node 0."""
    ips, nnodes, node_rank, master = config.ips, config.nnodes, config.node_rank, config.master
    port = config.started_port
    if port is not None:
        if not 0 < port < 65536:
            raise FleetConfigError(f"--started_port {port} must be a port, 1..65535")
        if master is not None:
            raise FleetConfigError(
                f"--started_port {port} and --master {master} both give the coordinator's "
                "port; give one of them"
            )
    if config.node_ip is not None and (ips is not None or (nnodes or 1) == 1):
        ips, node_rank = _node_from_ip(config.node_ip, ips, node_rank)
    if ips is not None:
        if not ips or not all(ips):
            raise FleetConfigError(f"--ips {','.join(ips)!r} must list one address per node")
        if nnodes is not None and nnodes != len(ips):
            raise FleetConfigError(
                f"--nnodes {nnodes} does not match --ips {','.join(ips)} ({len(ips)} "
                "nodes); drop --nnodes, --ips says how many nodes there are"
            )
        nnodes = len(ips)
        if node_rank is None:
            node_rank = _node_rank_from_ips(ips)
        if master is None and (nnodes > 1 or port is not None):
            master = f"{ips[0]}:{DEFAULT_PORT if port is None else port}"
    elif port is not None:
        master = f"{_net.LOOPBACK}:{port}"
    nnodes = nnodes or 1
    node_rank = 0 if node_rank is None else node_rank
    if not 0 <= node_rank < nnodes:
        raise FleetConfigError(
            f"--node_rank {node_rank} is outside --nnodes {nnodes} (allowed: "
            f"0..{nnodes - 1}); number the nodes 0, 1, ... and start one launcher on each"
        )
    if nnodes > 1 and master is None:
        raise FleetConfigError(
            f"a {nnodes}-node job needs the coordinator's address on every node: give "
            "--master HOST:PORT (HOST = node 0's address) or --ips ADDR0,ADDR1,..."
        )
    if master is not None:
        host, port = _net.split_host_port(master, "--master")
        if node_rank == 0 and nnodes == 1:  # several: the rendezvous listens there first
            _net.check_port_free(host, port)
    return nnodes, node_rank, master


def _node_from_ip(node_ip: str, ips: tuple[str, ...] | None,
                  node_rank: int | None) -> tuple[tuple[str, ...], int]:
    """``--node_ip``: this node's address; its place in ``--ips`` is the node rank."""
    if ips is None:
        return (node_ip,), 0 if node_rank is None else node_rank
    places = [i for i, ip in enumerate(ips) if ip == node_ip]
    if not places:
        raise FleetConfigError(
            f"--node_ip {node_ip} is not in --ips {','.join(ips)}; give this node's "
            "address as it appears in --ips (--cluster_node_ips)"
        )
    if node_rank is not None:
        if node_rank not in places:
            raise FleetConfigError(
                f"--node_rank {node_rank} and --node_ip {node_ip} disagree: --ips "
                f"{','.join(ips)} has {node_ip} at node {', '.join(map(str, places))}"
            )
        return ips, node_rank
    if len(places) > 1:
        raise FleetConfigError(
            f"--node_ip {node_ip} appears {len(places)} times in --ips {','.join(ips)} "
            f"(nodes {', '.join(map(str, places))}); pass --node_rank I to say which"
        )
    return ips, places[0]


def _node_rank_from_ips(ips: tuple[str, ...]) -> int:
    mine = _net.local_addresses()
    matches = [i for i, ip in enumerate(ips) if ip in mine]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise FleetConfigError(
            f"none of --ips {','.join(ips)} is an address of this machine, so its node "
            "rank is unknown; pass --node_rank I (I = this machine's index in --ips)"
        )
    raise FleetConfigError(
        f"--ips {','.join(ips)} lists this machine more than once (nodes "
        f"{', '.join(map(str, matches))}); pass --node_rank I to say which node this is"
    )


def make_log_dir(log_dir: str) -> None:
    """Creates ``log_dir`` (and its parents) and checks, before any worker starts,
    that a file can be written there (``fleetrun`` prints the error and exits 2).

    Whether the directory takes a file is asked by writing one (a temporary file,
    removed at once): permission bits do not stop root, a read-only mount stops
    everyone, and only the write itself tells both apart.

    Raises:
        fleet.FleetConfigError: it cannot be made or written; the message names
            the directory (or the parent that refused), why, and what to do.
    """
    try:
        os.makedirs(log_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fleetrun-write-test-", dir=log_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _unwritable(log_dir, e) from None


def _unwritable(log_dir: str, e: OSError) -> FleetConfigError:
    hit = _disk.nearest(log_dir)
    where = hit if hit == os.path.abspath(log_dir) else f"{hit} (to create {log_dir})"
    why = _disk.unwritable(e)
    said = f"it is {why}" if why is not None else "it cannot be written"
    return FleetConfigError(
        f"--log_dir {log_dir!r}: cannot write to {where}: {said} ([Errno {e.errno}] {e.strerror}). "
        "fleetrun writes each worker's output there (workerlog.RANK) before it starts "
        "them: give a writable directory with --log_dir DIR (or FLEETRUN_LOG_DIR=DIR), "
        "or remount the file system writable"
    )
