"""``fleet.distributed_optimizer``: Paddle's step 3, and where strategy features live.

Gradient synchronisation belongs to the wrapped model (:mod:`fleet.comm._sync`): its gradients
reach the optimizer averaged already, so this one does not reduce them again. What it adds:

* gradients that still differ across replicas (their vma type is varying) are
  averaged, in the strategy's buckets;
* under ``no_sync`` it does not step: parameters, optimizer state and ``step``
  stay as they are while the wrapped model accumulates the local gradients;
* with no wrapped model (an optax transformation on raw parameters, the
  functional style), JAX sums the parameters' gradients over the replicas (the
  transpose of using a replicated value with per-replica data); the step sees
  it in the program it traced, and this optimizer divides them by the replica
  count: the global-batch gradient again (one all-reduce per leaf, merged by
  XLA, instead of fleet's buckets);
* the strategy's optimizer sections: ``lars`` / ``lamb`` swap the inner optimizer
  (:mod:`fleet.sections._large_batch`); ``gradient_merge`` steps once every ``k_steps``
  calls; float16 ``amp`` keeps the loss scale and skips steps whose gradients are not finite.

Its state is the inner optimizer's state, plus what those sections keep: ``grad_accum``
(the wrapped model's local sums) and ``fleet_state`` (gradient merge's count, the loss
scale: :mod:`fleet.wrappers._fleet_state`), so with none of them on, checkpoints move
freely between single-device and distributed runs.

The optax transformation (the functional style, and the update inside this
optimizer) is :mod:`fleet.wrappers._distributed_tx`; gradient merge and the
``no_sync`` accumulator are :mod:`fleet.wrappers._gradient_merge`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fleet import _compat
from fleet._errors import FleetTypeError, FleetUnsupportedError
from fleet.comm import _sync
from fleet.comm._shard_comm import to_shards
from fleet.runtime._leaves import module_variables, variables_of
from fleet.runtime._replicate import replicate_in_place
from fleet.runtime._world import current_strategy
from fleet.sections import _amp, _finite_replay, _large_batch, _shard_probe, _sharding, _stage3
from fleet.wrappers._distributed_tx import _distributed_tx
from fleet.wrappers._fleet_state import FleetStateHolder
from fleet.wrappers._gradient_merge import GradientMerge


class DistributedOptimizer(GradientMerge, FleetStateHolder, nnx.Optimizer):
    """An ``nnx.Optimizer`` that averages gradients still differing across
    replicas and does not step under ``no_sync`` (see the module docstring).

    With ``strategy.gradient_merge`` it steps once every ``k_steps`` calls
    (``merge_count`` counts them); with float16 ``strategy.amp`` it holds the
    loss scale (``loss_scaling``, ``good_steps``, ``bad_steps``,
    ``skipped_steps``) and skips a step whose gradients are not finite. Those
    are views of ``fleet_state`` (:mod:`fleet.wrappers._fleet_state`)."""

    def __init__(self, optimizer: nnx.Optimizer):  # pylint: disable=super-init-not-called
        strategy = current_strategy()
        # A view of the wrapped optimizer: it shares every field (its step, state,
        # wrt...), whatever nnx.Optimizer holds; only the transformation changes.
        _compat.share_fields(self, optimizer)
        self.tx = _distributed_tx(optimizer.tx)
        self.init_fleet_state(strategy)  # gradient merge, float16 amp (fleet.wrappers._fleet_state)
        if self.merge is not None and _stage3.active(strategy):
            raise _stage3.refuse("gradient_merge")
        # strategy.sharding: the state is split at the first step, where the model's
        # parameters are known (ensure_sharded).
        self.params_split = False  # stage 3: the parameters it updates are split
        self.shard_pending = strategy.sharding and not self.sharded
        # Replicate the state on the mesh now (Adam's counters and ``step`` sit on
        # one device otherwise), equal on every replica.
        replicate_in_place(self)

    @property
    def sharded(self) -> bool:
        """Whether its state (stage 3: or its parameters, where its state holds
        nothing shaped like them, plain SGD) is split over the replicas
        (``strategy.sharding``)."""
        return self.params_split or any(isinstance(v, _sharding.ShardedState)
                                        for v in self._state_variables())

    def _state_variables(self) -> list:
        return [v for _, v in variables_of(self.opt_state)]

    def ensure_sharded(self, candidates: list) -> bool:
        """``strategy.sharding``: splits the parameter-shaped state over the
        replicas, for the parameters of the first of ``candidates`` (the step's
        other NNX objects) whose ``wrt`` state it was built on. Returns whether it
        did (the graph changed)."""
        if not self.shard_pending:
            return False
        inner = self.tx.inner
        state = nnx.as_pure(self.opt_state)
        want = jax.tree.structure(state)
        for obj in candidates:
            params = nnx.as_pure(nnx.state(obj, self.wrt, graph=self.graph))
            if not jax.tree.leaves(params):
                continue
            try:
                shapes = jax.eval_shape(inner.init, params)
            except Exception:  # noqa: BLE001 - not this object's parameters
                continue
            if jax.tree.structure(shapes) != want or any(
                    a.shape != jnp.shape(b) for a, b in zip(jax.tree.leaves(shapes),
                                                            jax.tree.leaves(state))):
                continue
            cfg = _sharding.config()
            layouts = _sharding.plan(inner.init, params, cfg)
            _shard_probe.verify(inner, params, cfg)
            for var, layout in zip(self._state_variables(), layouts):
                if layout is not None:
                    var.set_value(to_shards(var.get_value(), layout))
                    _sharding.mark_sharded(var, layout)
            if cfg.stage == 3:  # the parameters too (fleet.sections._stage3)
                _stage3.shard_parameters(obj, self.wrt, cfg)
                self.params_split = True
            self.shard_pending = False
            return True
        return False

    def update(self, model, grads, /, **kwargs):
        trace = _sync.current()
        if self.accumulated(trace, model, grads):  # no_sync, gradient merge: nothing steps
            return None
        if self.amp_rules is None or trace is None:
            return self._apply(model, grads, **kwargs)
        return self._update_or_skip(model, grads, **kwargs)

    def _apply(self, model, grads, /, **kwargs):
        rec = _finite_replay.recorder()
        if not self.sharded and rec is None:
            return super().update(model, grads, **kwargs)
        # nnx.Optimizer.update through the distributed update's parts (local_update),
        # sharded leaves as Shard nodes; check_nan_inf replays it (fleet.sections._finite_replay).
        model_state = nnx.state(model, self.wrt, graph=self.graph)
        variables = self._state_variables()
        layouts = map(_sharding.layout_of, variables)
        state = jax.tree.unflatten(jax.tree.structure(nnx.as_pure(self.opt_state)), [
            v.get_value() if lay is None else _sharding.Shard(v.get_value(), lay)
            for v, lay in zip(variables, layouts)])
        written = [*(v for _, v in variables_of(model_state)),
                   *variables, self.step]
        before, step = [v.get_raw_value() for v in written], self.step[...]
        core, args, finish = self.tx.local_update(
            nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph)), state,
            nnx.as_pure(model_state), **nnx.as_pure(kwargs))

        def applied(updates, new_state, keep=None):
            new_params, updates, new_state = finish(updates, new_state, keep)
            return new_params, updates, [x.value if _sharding.is_shard(x) else x for x in
                                         jax.tree.leaves(new_state, is_leaf=_sharding.is_shard)]

        new_params, updates, new_state = applied(*core(*args))
        nnx.update(model, new_params)
        for var, new in zip(variables, new_state):
            var.set_value(new)
        self.step[...] = step + 1
        if rec is not None:
            redo = _finite_replay.replay(core, args, state_at=1)

            def replayed(keep):  # the values of `written`, selected by keep
                new_params, _, new_state = applied(*redo(keep), keep)
                return [*jax.tree.leaves(new_params), *new_state, jnp.where(keep, step + 1, step)]

            rec.add([v.get_raw_value() for v in written], before, replayed)
        return updates

    def _update_or_skip(self, model, grads, **kwargs):
        """float16 amp: the update, kept only where every gradient is finite (the
        gradients are averaged over replicas, so all replicas agree); the scale
        moves by Paddle's rules either way."""
        kept = self._variables(model)
        before = [v.get_raw_value() for v in kept]
        self._apply(model, grads, **kwargs)
        trace = _sync.current()
        if trace.shard.finite is not None:  # sharded: agreed over the slices' owners
            finite = trace.shard.finite
        else:
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)
                                        if jnp.issubdtype(g.dtype, jnp.inexact)]))
        for v, old in zip(kept, before):
            v.set_raw_value(jnp.where(finite, v.get_raw_value(), old))
        state = self.pure_fleet_state()
        self.update_fleet_state(state._replace(amp=self.amp_rules.update(state.amp, finite)))
        return None

    def _variables(self, model) -> list:
        """What an update writes: the model's ``wrt`` variables, the optimizer
        state and its step counter."""
        wrt = nnx.filterlib.to_predicate(self.wrt)
        out = [v for k, v in module_variables(model).items() if wrt(tuple(k.split(".")), v)]
        out += [v for k, v in module_variables(self).items()
                if k == "step" or k.startswith("opt_state")]
        return out


def distributed_optimizer(optimizer: Any, strategy: Any = None) -> Any:
    """Makes an optimizer average gradients over the data-parallel replicas.

    Args:
        optimizer: an optax ``GradientTransformation`` (or ``optax.MultiSteps``)
            or an ``nnx.Optimizer`` (built on the model before or after
            ``fleet.distributed_model``).
        strategy: accepted for Paddle compatibility; the strategy given to
            ``fleet.init`` sets the buckets.

    Returns:
        The same kind of optimizer. Inside a :func:`fleet.distributed_step` its
        update averages the gradients that still differ across replicas (a wrapped
        model's gradients are averaged already and are not reduced again), then
        runs the original update; under ``no_sync`` it does not step.

    Example:
        >>> tx = fleet.distributed_optimizer(optax.adam(1e-3))  # doctest: +SKIP
        >>> opt = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    """
    del strategy
    strategy = current_strategy()
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer
    if isinstance(optimizer, nnx.Optimizer):
        # strategy.lars / strategy.lamb: Paddle swaps Momentum for LARS, Adam for LAMB.
        _large_batch.swap_optimizer_state(optimizer, _large_batch.swap_tx(optimizer.tx, strategy))
        return DistributedOptimizer(optimizer)
    if isinstance(optimizer, optax.MultiSteps):  # (not a GradientTransformation: it makes one)
        tx = distributed_optimizer(optimizer.gradient_transformation())
        tx.has_updated = optimizer.has_updated  # (what a loop asks of a MultiSteps)
        return tx
    if isinstance(optimizer, optax.GradientTransformation):
        needs = [name for name, on in (
            (f"gradient_merge (k_steps={strategy.gradient_merge_configs.k_steps})",
             strategy.gradient_merge and strategy.gradient_merge_configs.k_steps > 1),
            ("float16 amp (its loss scale)", strategy.amp and _amp.policy_of(strategy).loss_scaling),
        ) if on]
        if needs:
            raise FleetUnsupportedError(
                f"strategy {' and '.join(needs)} lives in a distributed nnx.Optimizer, and "
                "this is an optax transformation: write fleet.distributed_optimizer("
                "nnx.Optimizer(model, tx, wrt=nnx.Param)) (for a Linen TrainState, use "
                "optax.MultiSteps to merge gradients)")
        return _distributed_tx(_large_batch.swap_tx(optimizer, strategy))
    raise FleetTypeError(
        f"fleet.distributed_optimizer takes an optax.GradientTransformation or an "
        f"nnx.Optimizer, got {type(optimizer).__name__}; build one with e.g. "
        "optax.adam(1e-3) or nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)"
    )


# --------------------------------------------------------------------------- the step's side
# What fleet.distributed_step needs from the distributed optimizers among its
# arguments, before a call, inside the trace and after it.


def prepare_sharding(objs: tuple) -> bool:
    """``strategy.sharding``: before the first step, each distributed optimizer
    splits its state for the parameters of the model it gets here. Returns
    whether a graph changed."""
    changed = False
    for opt in objs:
        if isinstance(opt, DistributedOptimizer) and opt.shard_pending:
            changed |= opt.ensure_sharded([o for o in objs if o is not opt])
    return changed


def enter_trace(trace: _sync.SyncTrace, objs: tuple, *, grad_merge: str | None,
                sharded: bool, replicas: int) -> None:
    """What the strategy's sections need from the step's distributed optimizer:
    float16 amp's loss scale, gradient merge's divisor on the final call."""
    divisor = None
    for opt in objs:
        if not isinstance(opt, DistributedOptimizer):
            continue
        state = opt.pure_fleet_state()
        if state.amp is not None and trace.tx.loss_scale is None:
            trace.tx.loss_scale = divisor = state.amp.loss_scaling
        if opt.merge is not None:
            divisor = opt.merge.divisor(divisor, grad_merge)
    trace.tx.divisor = divisor
    trace.accum.merge_counts = grad_merge is not None
    if sharded:
        trace.shard.config = _sharding.config(replicas=replicas)
