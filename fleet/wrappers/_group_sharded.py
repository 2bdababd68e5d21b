"""``fleet.group_sharded_parallel``: Paddle's
``paddle.distributed.sharding.group_sharded_parallel(model, optimizer, level)``.

Paddle's other spelling of ZeRO: ``level="os"`` splits the optimizer state,
``"os_g"`` its gradients too, ``"p_g_os"`` the parameters too. fleet runs them
as ``strategy.sharding`` stages 1, 2 and 3 (:mod:`fleet.sections._sharding`,
:mod:`fleet.sections._stage3`): this function turns the section on in the
strategy ``fleet.init`` was given (the world is kept) and wraps the model and
the optimizer, as ``fleet.distributed_model`` / ``fleet.distributed_optimizer``.
"""

from __future__ import annotations

import copy
from typing import Any

from fleet._errors import FleetConfigError, FleetUnsupportedError
from fleet.runtime import _world
from fleet.wrappers._data_parallel import DataParallel, distributed_model
from fleet.wrappers._distributed_optimizer import distributed_optimizer

#: Paddle's levels and the stage each is.
LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}


def group_sharded_parallel(model: Any, optimizer: Any, level: str, scaler: Any = None,
                           group: Any = None, offload: bool = False,
                           sync_buffers: bool = False, buffer_max_size: int = 2**23,
                           segment_size: int = 2**20, sync_comm: bool = False,
                           dp_group: Any = None, exclude_layer: Any = None) -> tuple:
    """ZeRO at Paddle's ``level`` over all replicas (see the module docstring).

    Args:
        model: a Flax NNX or Linen module (wrapped here if it is not yet).
        optimizer: an ``nnx.Optimizer`` or an optax transformation.
        level: ``"os"``, ``"os_g"`` or ``"p_g_os"`` (stage 1, 2 or 3).
        scaler: returned as given (fleet's float16 loss scale lives in the
            distributed optimizer: ``strategy.amp``).
        segment_size: bytes of one all-gather bucket (``segment_broadcast_MB``).
        sync_buffers, buffer_max_size, sync_comm: accepted; fleet averages
            batch-norm statistics every step, and JAX schedules the collectives.
        group, dp_group, offload, exclude_layer: refused unless left at their
            defaults (fleet shards over all replicas, on the devices).

    Returns:
        ``(model, optimizer, scaler)``, as Paddle's.

    Example:
        >>> model, opt, _ = fleet.group_sharded_parallel(model, opt, "p_g_os")  # doctest: +SKIP
    """
    del sync_buffers, buffer_max_size, sync_comm
    if level not in LEVELS:
        raise FleetConfigError(
            f"group_sharded_parallel level must be one of {sorted(LEVELS)} ('os': the "
            f"optimizer state, 'os_g': and the gradients, 'p_g_os': and the parameters), "
            f"got {level!r}")
    given = {"group": group is not None, "dp_group": dp_group is not None,
             "offload": bool(offload), "exclude_layer": bool(exclude_layer)}
    if any(given.values()):
        name = next(k for k, v in given.items() if v)
        raise FleetUnsupportedError(
            f"group_sharded_parallel({name}=...) is not supported: fleet shards over all "
            "replicas of the data axis, on the devices; leave it at its default")
    if isinstance(segment_size, bool) or not isinstance(segment_size, int) or segment_size <= 0:
        raise FleetConfigError(
            f"group_sharded_parallel segment_size must be a positive number of bytes, got "
            f"{segment_size!r}")
    strategy = copy.deepcopy(_world.world().strategy)
    strategy.sharding = True
    strategy.sharding_configs = {"stage": LEVELS[level],
                                 "segment_broadcast_MB": segment_size / 2**20}
    _world.init(is_collective=True, strategy=strategy)
    if not isinstance(model, DataParallel):
        model = distributed_model(model)
    return model, distributed_optimizer(optimizer), scaler
