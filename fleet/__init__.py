"""fleet: data-parallel training for JAX, Flax and Optax, the Paddle Fleet way.

Four changes turn a single-device Flax + Optax script into a data-parallel one::

    import fleet                                          # 1
    fleet.init(is_collective=True)                        # 2
    model = fleet.distributed_model(model)                # 3
    optimizer = fleet.distributed_optimizer(optimizer)
    train_step = fleet.distributed_step(train_step)       # 4 (instead of jax.jit)

The public API is this module; everything else is private. The package is in
folders by layer, lowest first: the configuration (``fleet/strategy/``), the
runtime, gradient communication, the strategy sections, the wrappers, what a
step means across replicas, the step, then ``io``, ``checkpoint``, ``launch``
and ``hapi``. ``docs/architecture.md`` draws them and the path of one step call;
``tests/test_layers.py`` keeps the layers.
"""

# First, before anything starts JAX's CPU client: a thread pool large enough that
# XLA:CPU's collectives on several CPU devices cannot deadlock (fleet/runtime/_xla_flags.py).
import sys as _sys

from fleet.runtime._xla_flags import apply_cpu_collective_environ as _apply_cpu_collective_environ

if "jax" in _sys.modules:  # imported before fleet: it may have started its backends
    from fleet._compat import backends_are_initialized as _started

    _apply_cpu_collective_environ(started=_started)
else:
    _apply_cpu_collective_environ()

from fleet import io, optimizer, static
from fleet._errors import (
    FleetAttributeError,
    FleetConfigError,
    FleetError,
    FleetNotInitializedError,
    FleetTypeError,
    FleetUnsupportedError,
    FleetWarning,
)
from fleet.checkpoint import CheckpointManager, FleetCheckpointError, load, save
from fleet.comm._collective import all_gather, all_reduce, barrier, broadcast
from fleet.comm._reduce import fused_allreduce_gradients
from fleet.comm._replicas import check_replicas
from fleet.hapi import Model, callbacks, load_inference, metric
from fleet.launch import spawn
from fleet.runtime import _world
from fleet.runtime._agree import FleetTimeoutError
from fleet.runtime._world import (
    DATA_AXIS,
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
from fleet.step._decorator import DistributedStep, distributed_step
from fleet.strategy import DistributedStrategy
from fleet.wrappers._data_parallel import DataParallel, LinenDataParallel, distributed_model
from fleet.wrappers._distributed_optimizer import DistributedOptimizer, distributed_optimizer
from fleet.wrappers._group_sharded import group_sharded_parallel

__all__ = [
    # the job: joining it, and where this process sits in it
    "init",
    "init_parallel_env",
    "DistributedStrategy",
    "world",
    "worker_index",
    "worker_num",
    "is_first_worker",
    "num_replicas",
    "num_local_replicas",
    "barrier_worker",
    "spawn",
    # training data-parallel: the four changes
    "distributed_model",
    "DataParallel",
    "LinenDataParallel",
    "distributed_optimizer",
    "DistributedOptimizer",
    "distributed_step",
    "DistributedStep",
    "fused_allreduce_gradients",
    "group_sharded_parallel",
    "check_replicas",
    "io",
    "optimizer",
    # collectives (inside a step they run over the mesh axis DATA_AXIS, "data")
    "DATA_AXIS",
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    # checkpoints
    "save",
    "load",
    "CheckpointManager",
    # the high-level API
    "Model",
    "load_inference",
    "callbacks",
    "metric",
    "static",
    # errors
    "FleetError",
    "FleetAttributeError",
    "FleetCheckpointError",
    "FleetConfigError",
    "FleetNotInitializedError",
    "FleetTimeoutError",
    "FleetTypeError",
    "FleetUnsupportedError",
    "FleetWarning",
]

# A process the launcher started joins the job now, before the script computes
# (fleet.runtime._worker.join_launched_job: only that very process, never its children).
_world.join_launched_job()
