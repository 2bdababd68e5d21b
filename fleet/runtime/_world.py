"""The data-parallel world: ``fleet.init``, the mesh, and who this process is.

Every device of every process joins one mesh axis named ``data``. Devices are
ordered by process, then by id, so each process's devices form one contiguous
block of the axis: process ``p`` holds replicas
``[p * local, (p + 1) * local)`` and its local slice of a global batch is one
contiguous block of rows.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleet import _compat
from fleet._errors import FleetConfigError, FleetNotInitializedError, FleetUnsupportedError
from fleet.runtime import _xla_flags
from fleet.runtime._agree import join
from fleet.runtime._env import WorkerEnv
from fleet.runtime._worker import initialize_distributed, join_launched_job  # noqa: F401
from fleet.strategy import DistributedStrategy
from fleet.strategy._paddle_fields import check_degrees

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class World:
    """What ``fleet.init`` set up. Read it with :func:`world`."""

    mesh: Mesh
    strategy: DistributedStrategy
    env: WorkerEnv

    @property
    def num_replicas(self) -> int:
        return self.mesh.devices.size

    @property
    def num_local_replicas(self) -> int:
        return len(self.local_devices)

    @property
    def local_devices(self) -> list:
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    @functools.cached_property  # (read at every step call: made once)
    def replicated(self) -> NamedSharding:
        """Every replica holds the whole value (parameters, optimizer state)."""
        return NamedSharding(self.mesh, PartitionSpec())

    @functools.cached_property
    def batch(self) -> NamedSharding:
        """The leading axis is split over the replicas (batches)."""
        return NamedSharding(self.mesh, PartitionSpec(DATA_AXIS))


_WORLD: World | None = None
_said_alone: list[bool] = []  # the one-process line is printed once


def init(
    is_collective: bool = True,
    strategy: DistributedStrategy | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> World:
    """Sets up data-parallel training on every device of every process.

    In a multi-process job (started by ``fleetrun`` / ``fleet.spawn``, or any
    launcher that sets ``FLEET_*`` or Paddle's ``PADDLE_*`` variables, or JAX's own
    ``JAX_COORDINATOR_ADDRESS``) it first calls ``jax.distributed.initialize``, with
    gloo collectives on CPU. Call it before any other JAX work. Calling it again
    replaces the strategy and keeps the world.

    Args:
        is_collective: must be ``True``: fleet trains in collective (all-reduce) mode;
            Paddle's parameter-server mode is not supported.
        strategy: a :class:`fleet.DistributedStrategy`; ``None`` takes the defaults.
        devices: the devices to train on (default: every device of every process).
            A one-process script may pick a subset, e.g. ``jax.devices()[:2]``.

    Returns:
        The :class:`World` (mesh, strategy, worker environment).

    Example:
        >>> import fleet
        >>> world = fleet.init(is_collective=True)
        >>> world.mesh.axis_names
        ('data',)
    """
    global _WORLD
    # before the CPU client exists (a no-op after)
    _xla_flags.apply_cpu_collective_environ(started=_compat.backends_are_initialized)
    strategy = _checked_strategy(is_collective, strategy)
    env = WorkerEnv.from_environ()
    initialize_distributed(env)
    if _WORLD is not None and devices is None:
        check_degrees(strategy, _WORLD.num_replicas)
        _WORLD = dataclasses.replace(_WORLD, strategy=strategy)
        return _WORLD
    if devices is None:
        devices = jax.devices()
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise FleetConfigError(
            f"devices must be a non-empty sequence of jax.Device, got {devices!r}; "
            "pick them from jax.devices()"
        )
    mesh = Mesh(np.array(devices), (DATA_AXIS,))
    check_degrees(strategy, len(devices))
    _WORLD = World(mesh=mesh, strategy=strategy, env=env)
    _say_alone(env, devices)
    return _WORLD


def _checked_strategy(is_collective: bool, strategy: DistributedStrategy | None,
                      ) -> DistributedStrategy:
    """``init``'s arguments checked: collective mode only, and the strategy (the
    defaults for ``None``), checked and returned."""
    if not isinstance(is_collective, bool):
        raise FleetConfigError(
            f"fleet.init(is_collective={is_collective!r}): is_collective must be True or "
            "False (a bool); fleet trains collectively: write fleet.init(is_collective=True)"
        )
    if not is_collective:
        raise FleetUnsupportedError(
            "fleet.init(is_collective=False) asks for parameter-server mode, which fleet "
            "does not support; use fleet.init(is_collective=True) for collective "
            "data-parallel training"
        )
    if strategy is None:
        strategy = DistributedStrategy()
    elif not isinstance(strategy, DistributedStrategy):
        raise FleetConfigError(
            f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}"
        )
    strategy.check()
    return strategy


def _say_alone(env: WorkerEnv, devices: list) -> None:
    """The one-process line on stderr, printed once, for a script that no launcher
    started: how many devices it trains on, and that fleetrun starts several
    processes."""
    if env.launcher is None and jax.process_count() == 1 and not _said_alone:
        _said_alone.append(True)
        kind = devices[0].platform.upper() if devices[0].platform == "cpu" else \
            devices[0].device_kind
        print(f"fleet: 1 process, {len(devices)} {kind} device{'s' * (len(devices) > 1)}: "
              "data-parallel over this process's devices (fleetrun starts several "
              "processes)", file=sys.stderr, flush=True)


def init_parallel_env() -> World:
    """Paddle's ``paddle.distributed.init_parallel_env()``: ``init`` with defaults."""
    return init(is_collective=True)


def world() -> World:
    """The world ``fleet.init`` set up; raises if ``fleet.init`` was not called."""
    if _WORLD is None:
        raise FleetNotInitializedError(
            "fleet is not initialized; call fleet.init(is_collective=True) first"
        )
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None


def current_strategy() -> DistributedStrategy:
    """The strategy given to ``fleet.init`` (the defaults before it)."""
    return _WORLD.strategy if _WORLD is not None else DistributedStrategy()


def worker_index() -> int:
    """Index of this process in the job (Paddle's trainer id)."""
    return jax.process_index()


def worker_num() -> int:
    """Number of processes in the job.

    Not the number of replicas: in Paddle one worker drives one GPU, but here a
    process can hold several devices, each a replica. Split a global batch by
    :func:`num_replicas` (``global_batch // fleet.num_replicas()`` rows per
    replica); a ported ``global_batch // fleet.worker_num()`` is the rows per
    *process*, off by the local device count."""
    return jax.process_count()


def is_first_worker() -> bool:
    """Whether this is process 0 (log, save and print there)."""
    return jax.process_index() == 0


def num_replicas() -> int:
    """Number of data-parallel replicas: every device of every process
    (``worker_num() * num_local_replicas()`` when every process holds as many
    devices). What a global batch is split over; :func:`worker_num` counts
    processes."""
    return world().num_replicas


def num_local_replicas() -> int:
    """Number of data-parallel replicas (devices) in this process."""
    return world().num_local_replicas


def barrier_worker() -> None:
    """Waits until every process reaches this point (no-op for one process).

    Collective: a process that never arrives is named after at most
    ``FLEET_AGREE_TIMEOUT`` seconds (60)."""
    wait_for_all("fleet.barrier_worker")


def wait_for_all(call: str) -> None:
    """fleet's one barrier across processes (``fleet.barrier_worker``,
    ``fleet.barrier``): a process that never arrives is named after at most
    ``FLEET_AGREE_TIMEOUT`` seconds, in a message that names ``call``."""
    if jax.process_count() > 1:
        join(call)
        multihost_utils.sync_global_devices(call)


def first_local_replica(w: World | None = None) -> int:
    """Mesh index of this process's first device: the first replica it feeds.

    Example:
        >>> first_local_replica(init(is_collective=True))  # one process
        0
    """
    w = world() if w is None else w
    me = jax.process_index()
    return next(i for i, d in enumerate(w.mesh.devices.flat) if d.process_index == me)
