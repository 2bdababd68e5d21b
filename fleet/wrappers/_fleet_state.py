"""The strategy features' own step state, optax-style, in one place on the
distributed optimizer: ``fleet_state`` beside ``opt_state`` (issue 36 item 2).

Each feature that keeps state from call to call is an ``(init, update)`` pair,
as ``optax.MultiSteps`` and ``optax.apply_if_finite`` are, whose state is a
``NamedTuple``:

* ``strategy.gradient_merge``: :class:`~fleet.wrappers._gradient_merge.MergeSteps`,
  state :class:`~fleet.wrappers._gradient_merge.MergeState` (``mini_step``);
* float16 ``strategy.amp``: :class:`~fleet.sections._amp.ScaleRules`, state
  :class:`~fleet.sections._amp.ScaleState` (``loss_scaling``, ``good_steps``,
  ``bad_steps``, ``skipped_steps``).

:class:`FleetState` holds them (``None`` for a feature that is off, so with none
on the optimizer holds no more than ``nnx.Optimizer``). Inside the step a
feature reads the pure state (:meth:`FleetStateHolder.pure_fleet_state`) and
gives back a new one (:meth:`FleetStateHolder.update_fleet_state`, the one
place it is written). Checkpoints name the leaves by path,
``fleet_state.merge.mini_step``, ``fleet_state.amp.loss_scaling``...; a checkpoint
written before (``merge_count``, ``loss_scaling``... at the top) is read by
:mod:`fleet.checkpoint._migrate`.

(``check_nan_inf``'s chain is not here: it is the step's, not the optimizer's,
and lives on the host's ``fleet.sections._finite.FiniteFlags``.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx

from fleet.sections._amp import LossScale, ScaleRules, ScaleState, policy_of
from fleet.wrappers._gradient_merge import MergeCount, MergeState, MergeSteps


class FleetState(NamedTuple):
    """The features' states (``None``: the feature is off)."""

    merge: MergeState | None = None
    amp: ScaleState | None = None


class FleetStateHolder:
    """The distributed optimizer's part that holds :class:`FleetState`: the
    features (``merge``, ``amp_rules``) and ``fleet_state``, their state."""

    def init_fleet_state(self, strategy: Any) -> None:
        """The strategy's features and their initial state."""
        self.merge = MergeSteps.of(strategy)
        policy = policy_of(strategy)
        self.amp_rules = ScaleRules.of(strategy.amp_configs) if (
            policy and policy.loss_scaling) else None
        self.fleet_state = nnx.data(FleetState(
            merge=None if self.merge is None else jax.tree.map(MergeCount, self.merge.init()),
            amp=None if self.amp_rules is None else jax.tree.map(LossScale, self.amp_rules.init()),
        ))

    def pure_fleet_state(self) -> FleetState:
        """The features' state as arrays (tracers inside the step)."""
        return nnx.as_pure(self.fleet_state)

    def update_fleet_state(self, new: FleetState) -> None:
        """Writes ``new`` (a :class:`FleetState` of arrays, the same features on)."""
        variables = jax.tree.leaves(self.fleet_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        values = jax.tree.leaves(new)
        if jax.tree.structure(nnx.as_pure(self.fleet_state)) != jax.tree.structure(new):
            raise ValueError("fleet_state: the new state has other features than the old")
        for var, value in zip(variables, values):
            var.set_value(value)

    # float16 amp's state under its Paddle names (read by fleet.Model, and by scripts)
    loss_scaling = property(lambda self: self._amp_state().loss_scaling)
    good_steps = property(lambda self: self._amp_state().good_steps)
    bad_steps = property(lambda self: self._amp_state().bad_steps)
    skipped_steps = property(lambda self: self._amp_state().skipped_steps)

    def _amp_state(self) -> ScaleState:
        if self.fleet_state.amp is None:
            raise AttributeError("this distributed optimizer keeps no loss scale (only "
                                 "strategy.amp computing in float16 scales the loss)")
        return self.fleet_state.amp
