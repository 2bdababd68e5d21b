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

Its state is the inner optimizer's state, plus what those sections keep (``grad_accum``,
``merge_count``, the loss scale), so with none of them on, checkpoints move freely
between single-device and distributed runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fleet import _compat
from fleet._errors import FleetError, FleetTypeError, FleetUnsupportedError
from fleet.comm import _sync
from fleet.comm._buckets import strategy_buckets
from fleet.comm._reduce import reduce_gradients
from fleet.runtime._leaves import dotted, module_variables
from fleet.runtime._replicate import replicate_in_place
from fleet.runtime._world import current_strategy, world
from fleet.sections import _amp, _finite, _large_batch, _shard_probe, _sharding


class _AllReduceThen(optax.GradientTransformationExtraArgs):
    """Marks a transformation that fleet already made distributed."""


def _under_no_sync() -> bool:
    trace = _sync.current()
    return trace is not None and trace.accum.no_sync


def _distributed_tx(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    if isinstance(inner, _AllReduceThen):
        return inner
    inner = optax.with_extra_args_support(inner)
    buckets = strategy_buckets()
    shard = _sharding.config()

    def init(params):
        state = inner.init(params)
        if shard is None:
            return state
        # strategy.sharding: the parameter-shaped state, split over the replicas.
        _shard_probe.verify(inner, params, shard)
        return _sharding.shard_state(state, _sharding.plan(inner.init, params, shard))

    def prepare(grads):
        """The trace's bookkeeping of an update; raw parameters' summed gradients
        divided by the replica count."""
        if _under_no_sync():
            raise FleetUnsupportedError(
                "no_sync with an optax transformation (Linen / TrainState) is not supported: "
                "the parameters' gradients cannot stay local there. Use an NNX model with "
                "fleet.distributed_optimizer(nnx.Optimizer(...)), or accumulate inside the "
                "step with optax.MultiSteps"
            )
        trace = _sync.current()
        if trace is not None:
            trace.tx.calls += 1
            trace.tx.grads.update(trace.hold(jax.tree.leaves(grads)))
            if not trace.wrapped_syncs:
                flat = jax.tree_util.tree_flatten_with_path(grads)[0]
                trace.finite.record([f"gradient {dotted(p)!r}" for p, _ in flat],
                                    [g for _, g in flat])
            if trace.tx.auto_sum:  # raw parameters: JAX summed their gradients over replicas
                n = trace.num_replicas
                grads = jax.tree.map(
                    lambda g: g if _sync.is_varying(g) or not jnp.issubdtype(g.dtype, jnp.inexact)
                    else g / n, grads)
        return grads

    def local_update(grads, state, params=None, **extra):
        """The update in parts (see fleet.sections._sharding.local_update):
        ``core(*args)`` updates the arrays this replica holds (its slices under
        sharding), ``finish`` makes the full parameters, updates and state."""
        grads = prepare(grads)
        if any(map(_sharding.is_shard, jax.tree.leaves(state, is_leaf=_sharding.is_shard))):
            return _sharding.local_update(inner, grads, state, params, **extra)

        def core(g, s, p):
            return inner.update(g, s, p, **extra)

        def finish(updates, new_state, keep=None, *, apply=True):
            if params is None or not apply:
                return None, updates, new_state
            new_params = optax.apply_updates(params, updates)
            if keep is not None:  # check_nan_inf's replay (fleet.sections._finite)
                new_params = _finite.select(keep, new_params, params)
            return new_params, updates, new_state

        return core, (reduce_gradients(grads, buckets), state, params), finish

    def update(grads, state, params=None, **extra):
        core, args, finish = local_update(grads, state, params, **extra)
        return finish(*core(*args), apply=False)[1:]  # (updates, new state)

    tx = _AllReduceThen(inner.init if shard is None else init, update)
    tx.inner = inner
    tx.local_update = local_update
    return tx


class MergeCount(nnx.Variable):
    """``strategy.gradient_merge``: calls since the last optimizer step."""


class DistributedOptimizer(nnx.Optimizer):
    """An ``nnx.Optimizer`` that averages gradients still differing across
    replicas and does not step under ``no_sync`` (see the module docstring).

    With ``strategy.gradient_merge`` it steps once every ``k_steps`` calls
    (``merge_count`` counts them); with float16 ``strategy.amp`` it holds the
    loss scale (``loss_scaling``, ``good_steps``, ``bad_steps``,
    ``skipped_steps``) and skips a step whose gradients are not finite."""

    def __init__(self, optimizer: nnx.Optimizer):  # pylint: disable=super-init-not-called
        strategy = current_strategy()
        # A view of the wrapped optimizer: it shares every field (its step, state,
        # wrt...), whatever nnx.Optimizer holds; only the transformation changes.
        _compat.share_fields(self, optimizer)
        self.tx = _distributed_tx(optimizer.tx)
        self.merge_k = strategy.gradient_merge_configs.k_steps if strategy.gradient_merge else 1
        self.merge_avg = strategy.gradient_merge_configs.avg
        if self.merge_k > 1:
            self.merge_count = MergeCount(jnp.zeros((), jnp.int32))
        policy = _amp.policy_of(strategy)
        self.amp_rules = _amp.ScaleRules.of(strategy.amp_configs) if (
            policy and policy.loss_scaling) else None
        if self.amp_rules is not None:
            for name, var in _amp.scale_state(strategy.amp_configs.init_loss_scaling).items():
                setattr(self, name, var)
        # strategy.sharding: the state is split at the first step, where the model's
        # parameters are known (ensure_sharded).
        self.shard_pending = strategy.sharding and not self.sharded
        # Replicate the state on the mesh now (Adam's counters and ``step`` sit on
        # one device otherwise), equal on every replica.
        replicate_in_place(self)

    @property
    def sharded(self) -> bool:
        """Whether its state is split over the replicas (``strategy.sharding``)."""
        return any(isinstance(v, _sharding.ShardedState) for v in self._state_variables())

    def _state_variables(self) -> list:
        return jax.tree.leaves(self.opt_state, is_leaf=lambda v: isinstance(v, nnx.Variable))

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
                    var.set_value(_sharding.to_shards(var.get_value(), layout))
                    _sharding.mark_sharded(var, layout)
            self.shard_pending = False
            return True
        return False

    def ensure_accumulator(self, params: dict[str, tuple[tuple[int, ...], Any]]) -> bool:
        """Creates ``grad_accum`` (zeros, one local sum per replica) for the wrapped
        parameters ``{key: (shape, dtype)}``: before the first ``no_sync`` step, or
        before restoring a checkpoint taken between ``no_sync`` steps. Returns
        whether it created it (the graph changed)."""
        if getattr(self, "grad_accum", None) is not None:
            return False

        w = world()
        n = w.num_replicas
        entries = {}
        for key, (shape, dtype) in params.items():
            zeros = jax.make_array_from_callback(
                (n, *shape), w.batch, lambda idx, s=shape, d=dtype: np.zeros((n, *s), d)[idx])
            entries[_sync.accumulator_key(key)] = _sync.GradAccumulator(zeros)
        self.grad_accum = nnx.Dict(entries)
        return True

    def update(self, model, grads, /, **kwargs):
        trace = _sync.current()
        if self.merge_k > 1 and trace is not None and trace.accum.count_merge():
            self.merge_count[...] = (self.merge_count[...] + 1) % self.merge_k
        if _under_no_sync():  # add to the accumulator; nothing steps
            _sync.accumulate(nnx.to_pure_dict(nnx.state(grads, self.wrt)))
            return None
        if self.amp_rules is None or trace is None:
            return self._apply(model, grads, **kwargs)
        return self._update_or_skip(model, grads, **kwargs)

    def _apply(self, model, grads, /, **kwargs):
        rec = _finite.recorder()
        if not self.sharded and rec is None:
            return super().update(model, grads, **kwargs)
        # nnx.Optimizer.update through the distributed update's parts (local_update),
        # sharded leaves as Shard nodes; check_nan_inf replays it (fleet.sections._finite).
        model_state = nnx.state(model, self.wrt, graph=self.graph)
        variables = self._state_variables()
        layouts = map(_sharding.layout_of, variables)
        state = jax.tree.unflatten(jax.tree.structure(nnx.as_pure(self.opt_state)), [
            v.get_value() if lay is None else _sharding.Shard(v.get_value(), lay)
            for v, lay in zip(variables, layouts)])
        written = [*jax.tree.leaves(model_state, is_leaf=lambda x: isinstance(x, nnx.Variable)),
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
            redo = _finite.replay(core, args, state_at=1)

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
        scale, good, bad = _amp.next_scale(self.loss_scaling[...], self.good_steps[...],
                                           self.bad_steps[...], finite, self.amp_rules)
        self.loss_scaling[...], self.good_steps[...], self.bad_steps[...] = scale, good, bad
        self.skipped_steps[...] = self.skipped_steps[...] + (~finite).astype(jnp.int32)
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
        optimizer: an optax ``GradientTransformation`` or an ``nnx.Optimizer``
            (built on the model before or after ``fleet.distributed_model``).
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


def prepare_accumulators(objs: tuple) -> bool:
    """Before a no_sync step: gives each distributed optimizer its accumulator for
    the wrapped parameters among ``objs``. Returns whether a graph changed."""
    optimizers = [o for o in objs if isinstance(o, DistributedOptimizer)
                  and getattr(o, "grad_accum", None) is None]
    if not optimizers:  # (the usual case: created at the first no_sync step)
        return False
    params = {}
    for obj in objs:
        if not isinstance(obj, DistributedOptimizer):
            params.update({k: (v.get_raw_value().shape, v.get_raw_value().dtype)
                           for k, v in module_variables(obj).items()
                           if isinstance(v, _sync.SyncedRead)})
    return any([o.ensure_accumulator(params) for o in optimizers])


def prepare_sharding(objs: tuple) -> bool:
    """``strategy.sharding``: before the first step, each distributed optimizer
    splits its state for the parameters of the model it gets here. Returns
    whether a graph changed."""
    changed = False
    for opt in objs:
        if isinstance(opt, DistributedOptimizer) and opt.shard_pending:
            changed |= opt.ensure_sharded([o for o in objs if o is not opt])
    return changed


class MergePosition:
    """``strategy.gradient_merge``, on the host: where a step's calls sit in the
    merging optimizer's cycle of ``k_steps`` calls (a step holds one)."""

    def __init__(self) -> None:
        # id(optimizer) -> (its count array, weakly: a held one is copied at each donation)
        self._seen: dict[int, tuple] = {}  # and the count (see fleet.step._donate.unheld)

    def find(self, objs: tuple, no_sync: bool) -> tuple[Any, int]:
        """``strategy.gradient_merge``: the optimizer that merges, and where this
        call sits in its cycle of ``k_steps`` calls. The count lives on the
        device (it is checkpointed); the host follows it without reading it back,
        and reads it only when someone else wrote it (a restore)."""
        merging = [o for o in objs if isinstance(o, DistributedOptimizer) and o.merge_k > 1]
        if not merging or no_sync:  # explicit no_sync: accumulate, do not count
            return None, 0
        positions = []
        for opt in merging:
            value = opt.merge_count.get_raw_value()
            seen = self._seen.get(id(opt))
            if seen is None or seen[0]() is not value:
                seen = (weakref.ref(value), int(np.asarray(value.addressable_shards[0].data)))
                self._seen[id(opt)] = seen
            positions.append(seen[1])
        if len(set(positions)) > 1:
            raise FleetError(
                f"the step gets {len(merging)} optimizers that merge gradients, at different "
                f"points of their cycle ({positions}); pass one distributed optimizer")
        return merging[0], positions[0]

    def advanced(self, objs: tuple) -> None:
        """After a call that updated a merging optimizer: its new count, known."""
        for opt in objs:
            seen = self._seen.get(id(opt))
            if isinstance(opt, DistributedOptimizer) and seen is not None:
                self._seen[id(opt)] = (weakref.ref(opt.merge_count.get_raw_value()),
                                       (seen[1] + 1) % opt.merge_k)


def enter_trace(trace: _sync.SyncTrace, objs: tuple, *, grad_merge: str | None,
                sharded: bool, replicas: int) -> None:
    """What the strategy's sections need from the step's distributed optimizer:
    float16 amp's loss scale, gradient merge's divisor on the final call."""
    divisor = None
    for opt in objs:
        if not isinstance(opt, DistributedOptimizer):
            continue
        if opt.amp_rules is not None and trace.tx.loss_scale is None:
            trace.tx.loss_scale = divisor = opt.loss_scaling[...]
        if grad_merge == "final" and opt.merge_avg:
            k = jnp.asarray(opt.merge_k, jnp.float32)
            divisor = k if divisor is None else divisor * k
    trace.tx.divisor = divisor
    trace.accum.merge_counts = grad_merge is not None
    if sharded:
        trace.shard.config = _sharding.config(replicas=replicas)


def leave_accumulators(trace: _sync.SyncTrace, accum_keys: list, leaves: list) -> None:
    """The no_sync accumulators the step leaves: what this step added, zeros once
    a synced step consumed them, else as they were (a step that does not
    differentiate the model leaves them for the next one that does)."""
    for i, key in enumerate(accum_keys):
        if key is None:
            continue
        if key in trace.accum.left:
            new = trace.accum.left[key]
            leaves[i] = jnp.zeros_like(leaves[i]) if new is None else new
