"""``strategy.amp``: mixed precision, the Flax way, with Paddle's loss scaling.

Parameters stay float32 (the optimizer's master weights). Wrapping a model
sets the computation ``dtype`` of each of its layers (Flax's ``dtype`` field:
``nnx.Linear``, ``nnx.Conv``, ...), so the forward and backward compute in
bfloat16 or float16 while the parameters' gradients come back float32 and are
reduced and applied in float32. Layers on the black list (normalisation layers
by default, Paddle's ``custom_black_list`` adds module type names or paths)
compute in float32; the model's outputs are cast to float32, so the loss is
float32.

float16 also scales the loss (dynamic loss scaling): the cotangent of the
model's outputs is multiplied by the scale, the reduced gradients are divided
by it, and a step whose gradients are not finite on any replica is skipped on
all of them. The scale moves by Paddle's rules (:func:`next_scale`); its state
(:class:`ScaleState`, made and moved by :class:`ScaleRules`' ``init`` and
``update``) lives in the distributed optimizer's ``fleet_state.amp``, so
checkpoints carry it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from fleet._errors import FleetConfigError
from fleet.runtime._leaves import dotted


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a wrapped model computes in (from ``strategy.amp_configs``)."""

    dtype: Any  # jnp.bfloat16 or jnp.float16
    black_list: tuple[str, ...]
    loss_scaling: bool


def policy_of(strategy: Any) -> Policy | None:
    """The strategy's policy, or ``None`` when amp is off."""
    if not strategy.amp:
        return None
    cfg = strategy.amp_configs
    return Policy(jnp.dtype(cfg.compute_dtype), cfg.black_list(), cfg.loss_scaling)


def _black(path: str, module: Any, black_list: tuple[str, ...]) -> bool:
    names = {type(module).__name__, *(c.__name__ for c in type(module).__mro__)}
    return any(b in names or path == b or path.startswith(b + ".") for b in black_list)


def apply(model: nnx.Module, policy: Policy, name: str) -> int:
    """Sets the computation dtype of the model's layers; returns how many layers
    compute in low precision. A model with none of Flax's ``dtype`` fields is
    refused: amp would change nothing.

    Through Flax's ``nnx.Module.set_attributes``, whose filter sees each module
    with its path: one call sets the low-precision layers, one the black-listed
    ones, and each layer is chosen by its own path and type alone (a parent's
    choice does not carry over to its children)."""

    def black(path: tuple, module: Any) -> bool:
        return _black(dotted(path), module, policy.black_list)

    layers = [(path, m) for path, m in nnx.iter_modules(model) if hasattr(m, "dtype")]
    low = sum(not black(path, m) for path, m in layers)
    if not low:
        raise FleetConfigError(
            f"strategy.amp is on, but no layer of {name} has a Flax "
            "`dtype` field that fleet could set (nnx.Linear, nnx.Conv, ...), or all are on "
            "amp_configs.custom_black_list; build the model from Flax layers, or turn "
            "strategy.amp off"
        )
    # nnx.Module's own method, not one the user's class may define under that name
    nnx.Module.set_attributes(model, lambda path, m: not black(path, m), dtype=policy.dtype,
                              raise_if_not_found=False)
    nnx.Module.set_attributes(model, black, dtype=jnp.float32, raise_if_not_found=False)
    return low


def outputs_to_float32(out: Any) -> Any:
    """The model's low-precision float outputs, cast to float32 (the loss is float32)."""
    return jax.tree.map(
        lambda x: x.astype(jnp.float32)
        if isinstance(x, jax.Array) and x.dtype in (jnp.bfloat16, jnp.float16) else x, out)


@jax.custom_vjp
def scale_cotangent(x: Any, scale: jax.Array) -> Any:
    """Identity whose backward multiplies the cotangent by ``scale``: the loss
    scaled, seen from the model's outputs."""
    return x


def _scale_fwd(x, scale):
    return x, scale


def _scale_bwd(scale, ct):
    return jax.tree.map(lambda c: (c * scale).astype(c.dtype), ct), jnp.zeros_like(scale)


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


class ScaleState(NamedTuple):
    """float16 amp's dynamic loss-scaling state: the scale, Paddle's good- and
    bad-step counts, and the number of skipped steps (shown by ``fleet.Model``)."""

    loss_scaling: Any
    good_steps: Any
    bad_steps: Any
    skipped_steps: Any


@dataclasses.dataclass(frozen=True)
class ScaleRules:
    """Paddle's dynamic loss-scaling rules (from ``amp_configs``), as an
    optax-style ``(init, update)`` pair over :class:`ScaleState` (after
    ``optax.apply_if_finite``, which counts the skipped steps the same way)."""

    init_loss_scaling: float
    use_dynamic_loss_scaling: bool
    incr_every_n_steps: int
    decr_every_n_nan_or_inf: int
    incr_ratio: float
    decr_ratio: float

    @classmethod
    def of(cls, cfg: Any) -> ScaleRules:
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def init(self) -> ScaleState:
        zero = jnp.zeros((), jnp.int32)
        return ScaleState(jnp.asarray(self.init_loss_scaling, jnp.float32), zero, zero, zero)

    def update(self, state: ScaleState, finite: Any) -> ScaleState:
        """``state`` after a step whose gradients were ``finite`` (a bool array):
        :func:`next_scale`, and one more skipped step where they were not."""
        scale, good, bad = next_scale(state.loss_scaling, state.good_steps, state.bad_steps,
                                      finite, self)
        return ScaleState(scale, good, bad, state.skipped_steps + (~finite).astype(jnp.int32))


class LossScale(nnx.Variable):
    """Dynamic loss-scaling state of a distributed optimizer (float16 amp): the
    leaves of :class:`ScaleState` on the optimizer."""


def next_scale(scale, good, bad, finite, cfg: ScaleRules) -> tuple:
    """Paddle's ``update_loss_scaling``: after ``incr_every_n_steps`` finite
    steps in a row the scale grows by ``incr_ratio`` (if that stays finite);
    after ``decr_every_n_nan_or_inf`` non-finite ones it shrinks by
    ``decr_ratio`` (to at least 1). Each count restarts when it fires, and a
    step of the other kind resets it. Static scaling keeps the scale."""
    if not cfg.use_dynamic_loss_scaling:
        return scale, good, bad
    good_n = jnp.where(finite, good + 1, 0)
    bad_n = jnp.where(finite, 0, bad + 1)
    grown = scale * cfg.incr_ratio
    up = finite & (good_n == cfg.incr_every_n_steps)
    down = ~finite & (bad_n == cfg.decr_every_n_nan_or_inf)
    new = jnp.where(up, jnp.where(jnp.isfinite(grown), grown, scale), scale)
    new = jnp.where(down, jnp.maximum(scale * cfg.decr_ratio, 1.0), new)
    return (new.astype(scale.dtype), jnp.where(up, 0, good_n).astype(good.dtype),
            jnp.where(down, 0, bad_n).astype(bad.dtype))
