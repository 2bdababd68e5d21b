"""Each worker's environment for one attempt: :func:`plan_workers`.

A resolved :class:`~fleet.launch._config.LaunchConfig` becomes one
:class:`WorkerSpec` per local worker: its rank, the job's variables (Paddle's and
fleet's, ``fleet.runtime._env.WorkerEnv``), the heartbeat file, the timeouts,
and the addresses the coordinator and gloo bind to. :func:`worker_base_environ`
drops the variables a launcher owns from the environment the workers inherit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from fleet.launch import _devices, _net
from fleet.launch._config import LaunchConfig
from fleet.runtime import _heartbeat
from fleet.runtime._env import WorkerEnv
from fleet.runtime._worker import GLOO_ADDRESS

# jax.distributed's own heartbeat must not fire before fleet's watchdog does (it aborts
# the *healthy* processes when one is stopped, and the report would name the wrong
# rank), and never earlier than JAX's default.
_JAX_HEARTBEAT_MARGIN = 30
_JAX_HEARTBEAT_DEFAULT = 100


# Variables the launcher sets for each worker: never inherited from its own environment.
_OWNED = frozenset(
    WorkerEnv(world_size=2, coordinator="h:1", current_endpoint="h:1",
              trainer_endpoints=("h:1",), job_id="j").to_environ()
) | {_heartbeat.ENV, "FLEET_PROGRESS_TIMEOUT", "FLEET_JAX_HEARTBEAT_TIMEOUT",
     "JAX_COORDINATOR_BIND_ADDRESS", "FLAGS_selected_gpus", "FLEET_WORKER_PID", GLOO_ADDRESS}


def worker_base_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment without the variables it sets itself per worker."""
    return {k: v for k, v in environ.items() if k not in _OWNED}


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker of one attempt: who it is and the variables it gets."""

    rank: int
    local_rank: int
    environ: dict[str, str]


def plan_workers(
    config: LaunchConfig,
    restart_count: int,
    heartbeat_dir: str,
    environ: Mapping[str, str] | None = None,
) -> list[WorkerSpec]:
    """The environment of every local worker for one attempt of a resolved config."""
    environ = os.environ if environ is None else environ
    nproc, node = config.nproc_per_node, config.node_rank
    if config.master is None:  # single node: loopback, fresh ports each attempt
        ports = [_net.free_port() for _ in range(nproc)]
        master_host, master_port = _net.LOOPBACK, ports[0]
        local = [f"{_net.LOOPBACK}:{p}" for p in ports]
        endpoints: tuple[str, ...] = tuple(local)
    else:
        master_host, master_port = _net.split_host_port(config.master, "--master")
        hosts = config.ips or ((master_host,) if config.nnodes == 1 else None)
        if hosts is not None:
            endpoints = tuple(f"{h}:{master_port + i}" for h in hosts for i in range(nproc))
            local = list(endpoints[node * nproc:(node + 1) * nproc])
        else:  # --master only: the other nodes' addresses are not known here
            this = master_host if node == 0 else _this_host()
            local = [f"{this}:{master_port + i}" for i in range(nproc)]
            endpoints = ()
    coordinator = f"{master_host}:{master_port}"
    bind, gloo = _bind_addresses(config, master_host, master_port)
    jax_heartbeat = _JAX_HEARTBEAT_DEFAULT
    if config.progress_timeout:
        jax_heartbeat = max(jax_heartbeat, int(config.progress_timeout) + _JAX_HEARTBEAT_MARGIN)
    specs = []
    for local_rank in range(nproc):
        rank = node * nproc + local_rank
        env = WorkerEnv(
            rank=rank,
            world_size=config.world_size,
            local_rank=local_rank,
            local_world_size=nproc,
            node_rank=node,
            nnodes=config.nnodes,
            coordinator=coordinator,
            current_endpoint=local[local_rank],
            trainer_endpoints=endpoints,
            restart_count=restart_count,
            job_id=config.job_id,
        ).to_environ()
        env[_heartbeat.ENV] = _heartbeat.file_for(heartbeat_dir, rank)
        env["FLEET_PROGRESS_TIMEOUT"] = f"{config.progress_timeout:g}"
        env["FLEET_JAX_HEARTBEAT_TIMEOUT"] = str(jax_heartbeat)
        env["PYTHONUNBUFFERED"] = "1"
        env["PADDLE_LOG_DIR"] = os.path.abspath(config.log_dir)
        env[GLOO_ADDRESS] = gloo
        if rank == 0 and bind:
            env["JAX_COORDINATOR_BIND_ADDRESS"] = bind
        if config.gpus is not None:
            env.update(_devices.gpu_environ(config.gpus[local_rank]))
        elif config.cpu_devices is not None:
            env.update(_devices.cpu_environ(config.cpu_devices, environ))
        specs.append(WorkerSpec(rank=rank, local_rank=local_rank, environ=env))
    return specs


def _bind_addresses(config: LaunchConfig, master_host: str,
                    master_port: int) -> tuple[str | None, str]:
    """Where the coordinator listens (``None``: JAX's default, every interface) and
    the address of this node's gloo listeners: loopback on a single node; on several,
    the master's own address and this node's address that reaches the master."""
    if config.nnodes == 1:
        return f"{master_host}:{master_port}", _net.LOOPBACK
    master_ip = _net.resolve_ipv4(master_host)
    bind = f"{master_ip}:{master_port}" if master_ip else None
    return bind, _net.node_address(master_host, config.node_ip)


def _this_host() -> str:
    addresses = sorted(a for a in _net.local_addresses() if "." in a and not _net.is_loopback(a))
    return addresses[0] if addresses else _net.LOOPBACK
