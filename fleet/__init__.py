"""fleet: data-parallel training for JAX, Flax and Optax, the Paddle Fleet way.

Four changes turn a single-device Flax + Optax script into a data-parallel one::

    import fleet                                          # 1
    fleet.init(is_collective=True)                        # 2
    model = fleet.distributed_model(model)                # 3
    optimizer = fleet.distributed_optimizer(optimizer)
    train_step = fleet.distributed_step(train_step)       # 4 (instead of jax.jit)

The public API is this module; everything else is private.
"""

# First, before anything starts JAX's CPU client: a thread pool large enough that
# XLA:CPU's collectives on several CPU devices cannot deadlock (fleet/_xla_flags.py).
from fleet._xla_flags import apply_cpu_collective_environ as _apply_cpu_collective_environ

_apply_cpu_collective_environ()

from fleet import _world, io, optimizer
from fleet._agree import FleetTimeoutError
from fleet._buckets import BucketConfig
from fleet._collective import all_gather, all_reduce, barrier, broadcast
from fleet._env import WorkerEnv
from fleet._errors import (
    FleetAttributeError,
    FleetConfigError,
    FleetError,
    FleetNotInitializedError,
    FleetTypeError,
    FleetUnsupportedError,
    FleetWarning,
)
from fleet._model import DataParallel, LinenDataParallel, distributed_model
from fleet._optimizer import DistributedOptimizer, distributed_optimizer
from fleet._reduce import fused_allreduce_gradients
from fleet._replicas import check_replicas
from fleet._step import DistributedStep, distributed_step
from fleet._world import (
    DATA_AXIS,
    World,
    barrier_worker,
    init,
    init_parallel_env,
    is_first_worker,
    num_local_replicas,
    num_replicas,
    worker_index,
    worker_num,
    world,
)
from fleet.checkpoint import CheckpointManager, FleetCheckpointError, load, save
from fleet.hapi import Model, callbacks, metric
from fleet.launch import spawn
from fleet.strategy import DistributedStrategy

__all__ = [
    "DATA_AXIS",
    "CheckpointManager",
    "FleetCheckpointError",
    "load",
    "save",
    "BucketConfig",
    "DataParallel",
    "DistributedOptimizer",
    "DistributedStep",
    "LinenDataParallel",
    "Model",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "callbacks",
    "check_replicas",
    "distributed_model",
    "distributed_optimizer",
    "distributed_step",
    "fused_allreduce_gradients",
    "io",
    "optimizer",
    "DistributedStrategy",
    "FleetAttributeError",
    "FleetConfigError",
    "FleetError",
    "FleetNotInitializedError",
    "FleetTimeoutError",
    "FleetTypeError",
    "FleetUnsupportedError",
    "FleetWarning",
    "WorkerEnv",
    "World",
    "barrier_worker",
    "init",
    "init_parallel_env",
    "is_first_worker",
    "metric",
    "num_local_replicas",
    "num_replicas",
    "spawn",
    "worker_index",
    "worker_num",
    "world",
]

_world.join_launched_job()
