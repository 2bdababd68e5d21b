"""``fleet.strategy``: Paddle's ``DistributedStrategy``, and each section's implementation.

* ``_strategy.py``: the configuration, ``DistributedStrategy`` and its
  ``*_configs`` sections. It imports nothing of fleet but its errors: the core
  reads the configuration, never the other way round. This package's
  ``__init__`` imports only it. ``_paddle_fields.py``, beside it and as bare,
  says what each of Paddle 3.3's fields means in fleet (run, mapped, a no-op
  that warns, refused) and checks the degrees against the replica count.
* the sections, each built on the core (``fleet.comm._sync``, ``fleet.runtime._world``...),
  which imports them where it applies them (the wrapped model, the distributed
  optimizer, the step):

  - ``_amp.py``: ``strategy.amp``, the layers' computation dtype and float16
    loss scaling;
  - ``_recompute.py``: ``strategy.recompute``, named sub-modules under
    ``nnx.remat``;
  - ``_large_batch.py``: ``strategy.lars`` / ``strategy.lamb``;
  - ``_sharding.py``: ``strategy.sharding`` (ZeRO stages 1 and 2), with its
    collectives (``fleet/comm/_shard_comm.py``), its probe (``_shard_probe.py``) and the
    whole-tensor norms across slices (``_slices.py``).

  Gradient merge lives in the distributed optimizer (``fleet/wrappers/_distributed_optimizer.py``)
  and the step; ``fp16_allreduce`` is a communication hook (``fleet/comm/_hooks.py``).
"""

from fleet.strategy._strategy import (
    AmpConfigs,
    DistributedStrategy,
    GradientMergeConfigs,
    LambConfigs,
    LarsConfigs,
    RecomputeConfigs,
    ShardingConfigs,
)

__all__ = [
    "AmpConfigs",
    "DistributedStrategy",
    "GradientMergeConfigs",
    "LambConfigs",
    "LarsConfigs",
    "RecomputeConfigs",
    "ShardingConfigs",
]
