"""Configuration of fleet: ``DistributedStrategy`` and its feature sections."""

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
