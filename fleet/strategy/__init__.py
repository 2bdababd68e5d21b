"""``fleet.strategy``: Paddle's ``DistributedStrategy``: the configuration only.

* ``_strategy.py``: ``DistributedStrategy``, its fields and the sections switched
  on together; ``_configs.py``: each section's ``*_configs`` dataclass;
  ``_paddle_fields.py``: what each of Paddle 3.3's fields means in fleet (run,
  mapped, a no-op that warns, refused) and the degrees checked against the
  replica count.

It imports nothing of fleet but its errors: the core reads the configuration,
never the other way round. The sections' implementations live in
``fleet/sections/`` (amp, recompute, lars / lamb, sharding, sync_batch_norm,
check_nan_inf); ``fp16_allreduce`` is a communication hook (``fleet/comm/_hooks.py``);
gradient merge in the distributed optimizer
(``fleet/wrappers/_distributed_optimizer.py``) and the step.
"""

from fleet.strategy._configs import (
    AmpConfigs,
    GradientMergeConfigs,
    LambConfigs,
    LarsConfigs,
    RecomputeConfigs,
    ShardingConfigs,
)
from fleet.strategy._strategy import DistributedStrategy

__all__ = [
    "AmpConfigs",
    "DistributedStrategy",
    "GradientMergeConfigs",
    "LambConfigs",
    "LarsConfigs",
    "RecomputeConfigs",
    "ShardingConfigs",
]
