"""Configuration of fleet: ``DistributedStrategy`` and its feature sections.

It imports nothing of fleet but its errors (``fleet._errors``): the core reads
the configuration, never the other way round.
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
