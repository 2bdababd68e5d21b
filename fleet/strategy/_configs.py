"""The strategy sections' config dataclasses (``strategy.amp_configs = {...}``).

Each section of :class:`fleet.DistributedStrategy` is a switch plus one of these,
built from a dict key by key (:func:`make_config`): an unknown key fails at once
naming the closest valid ones, each value is type-checked against the field's
annotation and reviewed against Paddle's meaning (``_paddle_fields``), and the
config's own ``check`` validates the values together.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from fleet._errors import FleetAttributeError, FleetConfigError, FleetTypeError
from fleet.strategy import _paddle_fields
from fleet.strategy._paddle_fields import check_type as _check_type

#: The one default bucket size (MB of 2**20 bytes), and the cap of the first
#: bucket (``fuse_grad_size_in_MB``, ``last_comm_group_size_MB``).
DEFAULT_BUCKET_MB = 32.0
DEFAULT_LAST_BUCKET_MB = 1.0

_NORM_LAYERS = ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm")
_AMP_DTYPES = ("bfloat16", "float16")
_RECOMPUTE_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


def _one_of(owner: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise FleetConfigError(
            f"{owner} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def _positive(owner: str, value: Any, *, at_least: float = 0.0, strict: bool = True) -> None:
    bad = value <= at_least if strict else value < at_least
    if bad or value != value or value == float("inf"):
        relation = "greater than" if strict else "at least"
        raise FleetConfigError(f"{owner} must be a finite number {relation} {at_least}, "
                               f"got {value!r}")


def _names(owner: str, value: tuple) -> None:
    if not all(isinstance(v, str) and v for v in value):
        raise FleetTypeError(f"{owner} must be a list of non-empty strings, got {list(value)!r}")


@dataclasses.dataclass
class AmpConfigs:
    """Mixed precision (Paddle's ``amp_configs``; see docs/strategy.md).

    Parameters stay float32; the wrapped model computes in ``dtype``; gradients
    are reduced and applied in float32. ``float16`` uses dynamic loss scaling
    (Paddle's rules, state kept in the distributed optimizer); ``bfloat16`` needs
    none, so the scaling keys are then ignored.
    """

    init_loss_scaling: float = 32768.0
    incr_every_n_steps: int = 1000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.8
    use_dynamic_loss_scaling: bool = True
    custom_white_list: tuple = ()
    custom_black_list: tuple = ()
    use_pure_fp16: bool = False
    use_pure_bf16: bool = False
    dtype: str = "bfloat16"
    custom_black_varnames: tuple = ()  # Paddle's, no effect (as the two below)
    use_fp16_guard: bool = True
    use_optimizer_fp16: bool = False

    def check(self) -> None:
        _one_of("amp_configs.dtype", self.dtype, _AMP_DTYPES)
        _positive("amp_configs.init_loss_scaling", self.init_loss_scaling)
        _positive("amp_configs.incr_every_n_steps", self.incr_every_n_steps)
        _positive("amp_configs.decr_every_n_nan_or_inf", self.decr_every_n_nan_or_inf)
        _positive("amp_configs.incr_ratio", self.incr_ratio, at_least=1.0)
        _positive("amp_configs.decr_ratio", self.decr_ratio)
        if self.decr_ratio >= 1.0:
            raise FleetConfigError(
                f"amp_configs.decr_ratio must be below 1 (the scale shrinks after overflows), "
                f"got {self.decr_ratio}")
        _names("amp_configs.custom_white_list", self.custom_white_list)
        _names("amp_configs.custom_black_list", self.custom_black_list)
        both = sorted(set(self.custom_white_list) & set(self.custom_black_list))
        if both:
            raise FleetConfigError(
                f"amp_configs lists {both} in both custom_white_list and custom_black_list; "
                "keep each name in one of them")
        if self.use_pure_fp16 and self.use_pure_bf16:
            raise FleetConfigError(
                "amp_configs.use_pure_fp16 and use_pure_bf16 are both True; choose one")

    @property
    def compute_dtype(self) -> str:
        """The dtype the model computes in (``use_pure_*`` choose it too)."""
        if self.use_pure_fp16:
            return "float16"
        if self.use_pure_bf16:
            return "bfloat16"
        return self.dtype

    @property
    def pure(self) -> bool:
        """Pure mode (Paddle's O2): normalisation layers compute in ``dtype`` too."""
        return self.use_pure_fp16 or self.use_pure_bf16

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled: float16 only (bfloat16 has float32's range)."""
        return self.compute_dtype == "float16"

    def black_list(self) -> tuple:
        """Module type names or paths that compute in float32."""
        default = () if self.pure else _NORM_LAYERS
        return tuple(n for n in default if n not in self.custom_white_list) + tuple(
            self.custom_black_list)


@dataclasses.dataclass
class GradientMergeConfigs:
    """Gradient merge: one optimizer step every ``k_steps`` calls; gradients are
    summed locally in between and reduced once (averaged over the calls when
    ``avg``)."""

    k_steps: int = 1
    avg: bool = True

    def check(self) -> None:
        _positive("gradient_merge_configs.k_steps", self.k_steps)


@dataclasses.dataclass
class RecomputeConfigs:
    """Activation recomputation: ``checkpoints`` are the dotted paths of the
    wrapped model's sub-modules (``"blocks.0"``, ``"encoder"``) whose activations
    backward recomputes; ``policy`` names what they may keep
    (``jax.checkpoint_policies``); ``enable_offload`` keeps the matmul outputs in
    pinned host memory instead (:attr:`remat_policy`)."""

    checkpoints: tuple = ()
    policy: str = "nothing_saveable"
    enable_offload: bool = False
    checkpoint_shape: tuple = ()  # Paddle's, no effect (as the two below)
    enable_tuning: bool = False
    refined_ops_patterns: tuple = ()

    def check(self) -> None:
        _names("recompute_configs.checkpoints", self.checkpoints)
        _one_of("recompute_configs.policy", self.policy, _RECOMPUTE_POLICIES)
        if self.enable_offload and self.policy == "dots_saveable":
            raise FleetConfigError(
                "recompute_configs enable_offload=True offloads the matmul outputs without "
                "batch dimensions, and policy='dots_saveable' keeps every matmul output on the "
                "device; choose one (remove the policy, or enable_offload)")

    @property
    def remat_policy(self) -> str:
        """The ``jax.checkpoint_policies`` name the sub-modules run under."""
        return "offload_dot_with_no_batch_dims" if self.enable_offload else self.policy


@dataclasses.dataclass
class LarsConfigs:
    """LARS (swaps a Momentum optimizer for ``optax.lars``)."""

    lars_coeff: float = 0.001
    lars_weight_decay: float = 0.0005
    epsilon: float = 0.0
    exclude_from_weight_decay: tuple = ()


@dataclasses.dataclass
class LambConfigs:
    """LAMB (swaps an Adam optimizer for ``optax.lamb``)."""

    lamb_weight_decay: float = 0.01
    exclude_from_weight_decay: tuple = ()


@dataclasses.dataclass
class ShardingConfigs:
    """ZeRO sharding (``strategy.sharding``): ``stage`` 1 splits the optimizer
    state over ``sharding_degree`` replicas (0, the default: all of them; a
    divisor of the replica count shards inside groups and replicates across
    them), stage 2 the gradients too, stage 3 the parameters too (gathered per
    bucket where the model reads them); ``segment_broadcast_MB`` is the bucket size
    of the parameter all-gather."""

    stage: int = 1
    sharding_degree: int = 0
    segment_broadcast_MB: float = 32.0
    dp_degree: int = 1
    hybrid_dp: bool = False
    # Paddle's, no effect or refused above their default (_paddle_fields.KEYS):
    sharding_segment_strategy: str = "segment_broadcast_MB"
    segment_anchors: tuple = ()
    mp_degree: int = 1
    gradient_merge_acc_step: int = 1
    optimize_offload: bool = False
    pp_allreduce_in_optimize: bool = False
    pp_degree: int = 1
    optimize_cast: bool = False
    _dp_as_optimizer_sharding: bool = False
    enable_tuning: bool = False
    use_calc_stream: bool = False

    def check(self) -> None:
        _one_of("sharding_configs.stage", self.stage, (1, 2, 3))
        _positive("sharding_configs.sharding_degree", self.sharding_degree, strict=False)
        _positive("sharding_configs.segment_broadcast_MB", self.segment_broadcast_MB)
        _positive("sharding_configs.dp_degree", self.dp_degree, at_least=1, strict=False)

    def degree(self, num_replicas: int) -> int:
        """The number of replicas the state is split over, checked against the
        replica count."""
        degree = self.sharding_degree or num_replicas
        if degree > num_replicas or num_replicas % degree:
            divisors = [d for d in range(1, num_replicas + 1) if num_replicas % d == 0]
            raise FleetConfigError(
                f"sharding_configs.sharding_degree={self.sharding_degree} does not divide the "
                f"{num_replicas} replicas; use one of {divisors} (or 0: all replicas)")
        return degree


# Feature sections: switch name -> config dataclass.
SECTIONS: dict[str, type] = {
    "amp": AmpConfigs,
    "gradient_merge": GradientMergeConfigs,
    "recompute": RecomputeConfigs,
    "lars": LarsConfigs,
    "lamb": LambConfigs,
    "sharding": ShardingConfigs,
}


def unknown(owner: str, name: str, valid: list[str]) -> FleetAttributeError:
    lower = {v.lower(): v for v in valid}  # a wrong case first names the field itself
    close = [lower[c] for c in difflib.get_close_matches(name.lower(), list(lower), n=3, cutoff=0.5)]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return FleetAttributeError(
        f"{owner} has no field {name!r}{hint} Valid fields: {', '.join(sorted(valid))}"
    )


def make_config(section: str, value: Any) -> Any:
    cls = SECTIONS[section]
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise FleetTypeError(
            f"DistributedStrategy.{section}_configs must be a dict or {cls.__name__}, "
            f"got {type(value).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    config = cls()
    for key, item in value.items():
        if key not in fields:
            raise unknown(f"DistributedStrategy.{section}_configs", key, list(fields))
        setattr(config, key, _check_type(f"{section}_configs", key, item, hints[key]))
        _paddle_fields.review(f"{section}_configs", key, getattr(config, key),
                              _paddle_fields.KEYS[f"{section}_configs"].get(key), stacklevel=4)
    if hasattr(config, "check"):
        config.check()
    return config
