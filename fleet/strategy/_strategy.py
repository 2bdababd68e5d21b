"""``DistributedStrategy``: Paddle's attribute-style strategy, typed and validated.

Paddle warns on a misspelt field and goes on with the default; fleet fails at
once, naming the closest valid fields. Each field has a type and a default. A
feature section is a switch (``strategy.amp = True``) plus a small config
dataclass (``strategy.amp_configs = {...}``) validated key by key; sections that
fleet does not run yet are accepted as configuration but refused by
``fleet.init`` with a clear "not supported" error, so scripts fail loudly
instead of silently training without the feature.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, ClassVar

from fleet._context import DEFAULT_BUCKET_MB, DEFAULT_LAST_BUCKET_MB
from fleet._errors import FleetAttributeError, FleetConfigError, FleetTypeError


@dataclasses.dataclass
class AmpConfigs:
    init_loss_scaling: float = 32768.0
    incr_every_n_steps: int = 1000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.8
    use_dynamic_loss_scaling: bool = True
    use_pure_fp16: bool = False


@dataclasses.dataclass
class GradientMergeConfigs:
    k_steps: int = 1
    avg: bool = True


@dataclasses.dataclass
class RecomputeConfigs:
    checkpoints: tuple = ()


@dataclasses.dataclass
class LarsConfigs:
    lars_coeff: float = 0.001
    lars_weight_decay: float = 0.0005
    epsilon: float = 0.0
    exclude_from_weight_decay: tuple = ()


@dataclasses.dataclass
class LambConfigs:
    lamb_weight_decay: float = 0.01
    exclude_from_weight_decay: tuple = ()


@dataclasses.dataclass
class ShardingConfigs:
    sharding_degree: int = 8
    segment_broadcast_MB: float = 32.0


# Feature sections: switch name -> config dataclass. fleet runs none of them yet.
_SECTIONS: dict[str, type] = {
    "amp": AmpConfigs,
    "gradient_merge": GradientMergeConfigs,
    "recompute": RecomputeConfigs,
    "lars": LarsConfigs,
    "lamb": LambConfigs,
    "sharding": ShardingConfigs,
}


def _check_type(owner: str, name: str, value: Any, expected: Any) -> Any:
    """Returns ``value`` converted to ``expected`` where that loses nothing, else raises."""
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is tuple:
        ok = isinstance(value, (tuple, list))
        value = tuple(value) if ok else value
    else:  # pragma: no cover - every field above has one of these types
        ok = isinstance(value, expected)
    if not ok:
        raise FleetTypeError(
            f"{owner}.{name} must be of type {expected.__name__}, got "
            f"{value!r} of type {type(value).__name__}"
        )
    return value


def _unknown(owner: str, name: str, valid: list[str]) -> FleetAttributeError:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return FleetAttributeError(
        f"{owner} has no field {name!r}{hint} Valid fields: {', '.join(sorted(valid))}"
    )


def _make_config(section: str, value: Any) -> Any:
    cls = _SECTIONS[section]
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
            raise _unknown(f"DistributedStrategy.{section}_configs", key, list(fields))
        setattr(config, key, _check_type(f"{section}_configs", key, item, hints[key]))
    return config


@dataclasses.dataclass(init=False)
class DistributedStrategy:
    """How fleet trains data-parallel. Set fields as attributes, as in Paddle.

    Example:
        >>> import fleet
        >>> strategy = fleet.DistributedStrategy()
        >>> strategy.fuse_grad_size_in_MB = 16
        >>> strategy.fuse_grad_size_in_MB
        16.0

    Fields:
        fuse_all_reduce_ops: group gradients into buckets, one ``psum`` per bucket
            (``False``: one ``psum`` per gradient leaf).
        fuse_grad_size_in_MB: bucket size in MB (``DataParallel.comm_buffer_size``).
        last_comm_group_size_MB: size cap in MB of the bucket holding the model's
            first layers (``DataParallel.last_comm_buffer_size``).
        find_unused_parameters: accepted for Paddle scripts and not used: in JAX a
            parameter that does not reach the loss simply gets a zero gradient.
        check_replicas_every_n_steps: every this many calls, a distributed step
            checks that every replica's copy of its state and outputs agree
            (:func:`fleet.check_replicas`) and raises, naming the first leaf that
            differs (0, the default: never).
        check_nan_inf: Paddle's ``FLAGS_check_nan_inf``: a step whose outputs (the
            loss) or whose wrapped model's gradients hold a NaN or an infinity
            raises, naming the first such leaf, and leaves the state as it was
            before that step (off by default: it reads flags back every step).
        amp, gradient_merge, recompute, lars, lamb, sharding (+ ``*_configs``):
            Paddle's feature sections; configurable, not run yet (``fleet.init``
            refuses a strategy that turns one on).
    """

    fuse_all_reduce_ops: bool = True
    fuse_grad_size_in_MB: float = DEFAULT_BUCKET_MB
    last_comm_group_size_MB: float = DEFAULT_LAST_BUCKET_MB
    find_unused_parameters: bool = False
    check_replicas_every_n_steps: int = 0
    check_nan_inf: bool = False

    _POSITIVE: ClassVar[tuple[str, ...]] = ("fuse_grad_size_in_MB", "last_comm_group_size_MB")

    def __init__(self, **fields: Any):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.default)
        for section, cls in _SECTIONS.items():
            object.__setattr__(self, section, False)
            object.__setattr__(self, f"{section}_configs", cls())
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def field_names(cls) -> list[str]:
        names = [f.name for f in dataclasses.fields(cls)]
        for section in _SECTIONS:
            names += [section, f"{section}_configs"]
        return names

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SECTIONS:
            value = _check_type("DistributedStrategy", name, value, bool)
        elif name.endswith("_configs") and name[: -len("_configs")] in _SECTIONS:
            value = _make_config(name[: -len("_configs")], value)
        else:
            hints = typing.get_type_hints(type(self))
            if name not in {f.name for f in dataclasses.fields(self)}:
                raise _unknown("DistributedStrategy", name, self.field_names())
            value = _check_type("DistributedStrategy", name, value, hints[name])
            if name in self._POSITIVE and not (0 < value < float("inf")):
                raise FleetConfigError(
                    f"DistributedStrategy.{name} must be a positive, finite number of MB, "
                    f"got {value}"
                )
            if name == "check_replicas_every_n_steps" and value < 0:
                raise FleetConfigError(
                    f"DistributedStrategy.{name} must be 0 (off) or a positive number of "
                    f"steps, got {value}"
                )
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a misspelt field.
        if name.startswith("__"):
            raise AttributeError(name)
        raise _unknown("DistributedStrategy", name, self.field_names())

    def enabled_sections(self) -> list[str]:
        """The feature sections switched on (``amp``, ``sharding``, ...)."""
        return [s for s in _SECTIONS if getattr(self, s)]

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        sections = ", ".join(f"{s}=True" for s in self.enabled_sections())
        return f"DistributedStrategy({fields}{', ' + sections if sections else ''})"
