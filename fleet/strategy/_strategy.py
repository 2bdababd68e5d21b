"""``DistributedStrategy``: Paddle's attribute-style strategy, typed and validated.

Paddle warns on a misspelt field and goes on with the default; fleet fails at
once, naming the closest valid fields. The sections' configs: ``_configs.py``;
Paddle's other fields, kept, warned about or refused: ``_paddle_fields.py``.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Any, ClassVar

from fleet._errors import FleetConfigError, FleetWarning
from fleet.strategy import _paddle_fields
from fleet.strategy._configs import (
    DEFAULT_BUCKET_MB,
    DEFAULT_LAST_BUCKET_MB,
    SECTIONS,
    make_config,
    unknown,
)
from fleet.strategy._paddle_fields import check_type as _check_type


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
            differs (default 500: under 0.1% of a step on the CIFAR CNN and the
            25M MLP, ``benchmarks/check_replicas.py``; 0: never).
        verify_steps: for the first this many calls of each compiled step, run
            the single-device step on the global batch beside the distributed one
            and raise, naming the first state leaf or output that differs beyond
            the float noise floor (:mod:`fleet.step._verify`; 0, the default: off). The
            environment variable ``FLEET_VERIFY_STEPS`` overrides it, so an
            unchanged script is checked with ``FLEET_VERIFY_STEPS=3 fleetrun train.py``.
        check_nan_inf: Paddle's ``FLAGS_check_nan_inf``: a step whose outputs (the
            loss) or whose wrapped model's gradients hold a NaN or an infinity
            raises, naming the first such leaf and call, and leaves the state as it
            was before that call; it raises at a later call, once the flags are back.
        fp16_allreduce: gradient buckets travel as 16-bit floats (bfloat16;
            float16 under float16 amp), divided by the replica count first.
        sync_batch_norm: how a wrapped model's BatchNorm layers (``nnx.BatchNorm``;
            a Linen ``nn.BatchNorm`` unless its ``axis_name`` is
            ``fleet.DATA_AXIS``) normalise in training mode inside a step: ``True``, over the global
            batch (equal to one device; one small all-reduce per layer);
            ``False``, each replica over its own rows (DDP's per-replica
            statistics, the one deliberate difference from one device); not set
            (``None``), a step that runs one in training mode raises and asks.
        amp, recompute, gradient_merge, lars, lamb, sharding (+ ``*_configs``):
            Paddle's feature sections (see docs/strategy.md).
        Paddle's other fields (``hybrid_configs``, ``a_sync``, ``dgc``...): kept
            with Paddle's defaults; each is mapped, a no-op that warns, or refused
            (``fleet/strategy/_paddle_fields.py``, ``docs/strategy_fields.md``).
    """

    fuse_all_reduce_ops: bool = True
    fuse_grad_size_in_MB: float = DEFAULT_BUCKET_MB
    last_comm_group_size_MB: float = DEFAULT_LAST_BUCKET_MB
    find_unused_parameters: bool = False
    check_replicas_every_n_steps: int = 500
    verify_steps: int = 0
    check_nan_inf: bool = False
    fp16_allreduce: bool = False
    sync_batch_norm: bool | None = None

    _POSITIVE: ClassVar[tuple[str, ...]] = ("fuse_grad_size_in_MB", "last_comm_group_size_MB")

    def __init__(self, **fields: Any):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.default)
        for section, cls in SECTIONS.items():
            object.__setattr__(self, section, False)
            object.__setattr__(self, f"{section}_configs", cls())
        object.__setattr__(self, "_paddle", {n: _paddle_fields.paddle_default(n) for n in _PADDLE})
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def field_names(cls) -> list[str]:
        names = [f.name for f in dataclasses.fields(cls)]
        for section in SECTIONS:
            names += [section, f"{section}_configs"]
        return names + sorted(_PADDLE)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SECTIONS:
            value = _check_type("DistributedStrategy", name, value, bool)
        elif name.endswith("_configs") and name[: -len("_configs")] in SECTIONS:
            value = make_config(name[: -len("_configs")], value)
        elif name in _PADDLE:
            self._paddle[name] = _paddle_fields.paddle_value(name, value)
            return
        else:
            hints = typing.get_type_hints(type(self))
            if name not in {f.name for f in dataclasses.fields(self)}:
                raise unknown("DistributedStrategy", name, self.field_names())
            value = _check_type("DistributedStrategy", name, value, hints[name])
            if name in self._POSITIVE and not (0 < value < float("inf")):
                raise FleetConfigError(
                    f"DistributedStrategy.{name} must be a positive, finite number of MB, "
                    f"got {value}"
                )
            if name in ("check_replicas_every_n_steps", "verify_steps") and value < 0:
                raise FleetConfigError(
                    f"DistributedStrategy.{name} must be 0 (off) or a positive number of "
                    f"steps, got {value}"
                )
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a misspelt field.
        if name.startswith("__") or name == "_paddle":
            raise AttributeError(name)
        if name in _PADDLE:
            value = self._paddle[name]
            return dict(value) if isinstance(value, dict) else value
        raise unknown("DistributedStrategy", name, self.field_names())

    def enabled_sections(self) -> list[str]:
        """The feature sections switched on (``amp``, ``sharding``, ...)."""
        return [s for s in SECTIONS if getattr(self, s)]

    def check(self) -> None:
        """Checks the sections switched on, together (``fleet.init`` calls it):
        a section fleet does not run, or settings that contradict each other,
        raise an error that says what to change."""
        _paddle_fields.check_switches(self._paddle)
        enabled = self.enabled_sections()
        for section, cls in SECTIONS.items():
            config = getattr(self, f"{section}_configs")
            used = section == "amp" and self.fp16_allreduce  # its dtype picks the wire's
            if section not in enabled and config != cls() and not used:
                warnings.warn(
                    f"strategy.{section}_configs is set ({config}) but strategy.{section} is "
                    f"off, so it has no effect; set strategy.{section} = True to use it",
                    FleetWarning, stacklevel=3)
        for section in enabled:
            config = getattr(self, f"{section}_configs")
            if hasattr(config, "check"):
                config.check()
        if self.lars and self.lamb:
            raise FleetConfigError(
                "strategy.lars and strategy.lamb are both on; choose one (LARS replaces a "
                "Momentum optimizer, LAMB an Adam one)")
        if self.recompute and not self.recompute_configs.checkpoints:
            raise FleetConfigError(
                "strategy.recompute is on but recompute_configs.checkpoints names no "
                "sub-module; list the wrapped model's sub-modules to recompute, e.g. "
                "strategy.recompute_configs = {'checkpoints': ['block1', 'block2']}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        sections = ", ".join(f"{s}=True" for s in self.enabled_sections())
        return f"DistributedStrategy({fields}{', ' + sections if sections else ''})"


#: Paddle's top-level fields fleet keeps as given (with Paddle's defaults) and reviews.
_PADDLE = frozenset(_paddle_fields.TOP).difference(
    [f.name for f in dataclasses.fields(DistributedStrategy)], SECTIONS,
    [f"{s}_configs" for s in SECTIONS])
