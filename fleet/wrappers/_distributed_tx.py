"""``fleet.distributed_optimizer`` on an optax transformation: the functional style.

Moved out of :mod:`fleet.wrappers._distributed_optimizer` (issue 36), which keeps
the ``nnx.Optimizer`` form and uses this transformation inside it. With no wrapped
model (an optax transformation on raw parameters), JAX sums the parameters'
gradients over the replicas (the transpose of using a replicated value with
per-replica data); the step sees it in the program it traced, and this
transformation divides them by the replica count: the global-batch gradient again
(one all-reduce per leaf, merged by XLA, instead of fleet's buckets). Gradients
that still differ across replicas (their vma type is varying) are averaged, in
the strategy's buckets. Under ``strategy.sharding`` its parameter-shaped state
is split over the replicas (:mod:`fleet.sections._sharding`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from fleet._errors import FleetUnsupportedError
from fleet.comm import _sync
from fleet.comm._buckets import strategy_buckets
from fleet.comm._reduce import reduce_gradients
from fleet.runtime._leaves import dotted
from fleet.sections import _finite_replay, _shard_probe, _sharding, _stage3


class AllReduceThen(optax.GradientTransformationExtraArgs):
    """Marks a transformation that fleet already made distributed."""


def _under_no_sync() -> bool:
    trace = _sync.current()
    return trace is not None and trace.accum.no_sync


def _prepare(grads):
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
            # (raw parameters: JAX may have summed their gradients over the replicas;
            # the probe assumes it did, and its checks find out: fleet.step._first_trace)
            if trace.tx.assume_sum:
                trace.tx.summed |= any(map(_summed_by_jax, jax.tree.leaves(grads)))
            summed = trace.tx.auto_sum or trace.tx.assume_sum
            grads = fleet_tx_grads(grads, trace.num_replicas if summed else 1)
    return grads


def _summed_by_jax(g) -> bool:
    """Whether a raw parameter's gradient is one JAX may have summed over the
    replicas: a float typed the same on every replica."""
    return jnp.issubdtype(g.dtype, jnp.inexact) and not _sync.is_varying(g)


@functools.partial(jax.jit, static_argnums=1)
def fleet_tx_grads(grads, n: int):
    """Raw parameters' gradients handed to a distributed optimizer: divided by
    ``n``, the replicas JAX summed them over, as one call the probe recognises:
    every other use of such a sum in the step is refused
    (fleet.step._guards.summed_uses)."""
    return jax.tree.map(lambda g: g / n if _summed_by_jax(g) else g, grads)


def _refuse_per_replica_extra(extra: dict, params) -> None:
    """An extra argument of the update (optax's ``value=``, ``value_fn=``, ...) that
    differs across replicas would step each replica's optimizer differently, where
    one device steps once on the global batch's value: refused, naming it. So is
    ``obj_fn=``, which fleet cannot differentiate as it is asked to."""
    if callable(extra.get("obj_fn")):
        raise FleetUnsupportedError(
            "the optimizer's update was given obj_fn=, a function of the parameters that it "
            "differentiates forward-mode (optax.contrib.sophia's Hessian estimate: jax.jvp of "
            "its gradient). Inside a fleet step a wrapped model's gradient sync and "
            "fleet.all_reduce are custom_vjp functions, which JAX differentiates backward "
            "only, so fleet cannot run that estimate: use an optimizer that needs the "
            "gradients alone (optax.adamw, optax.contrib.adopt), or this one on one device")
    for name, value in extra.items():
        function = name == "value_fn" and callable(value) and params is not None
        if function:
            try:  # optax's line searches call value_fn(params): its value's type
                value = jax.eval_shape(value, params)
            except Exception:  # noqa: BLE001 - not optax's value_fn(params): left to optax
                continue
        if any(_sync.is_varying(v) for v in jax.tree.leaves(value)
               if isinstance(v, (jax.Array, jax.ShapeDtypeStruct))):
            what, fix = (("a function whose value", f"{name}=lambda p: fleet.all_reduce("
                          "loss_of(p), 'avg')") if function else
                         ("a value that", f"{name}=fleet.all_reduce(loss, 'avg')"))
            raise FleetUnsupportedError(
                f"the optimizer's update was given {name}= {what} differs across replicas "
                f"(computed from this replica's rows, such as its loss): each replica's "
                f"optimizer would step on its own, where one device steps on the global "
                f"batch's. Pass the global value: {fix} for a mean over the rows ('sum' for "
                f"a sum), which is the loss itself on one device")


def _distributed_tx(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` made distributed (see the module docstring); ``local_update``
    gives its update in parts, for ``DistributedOptimizer`` and check_nan_inf."""
    if isinstance(inner, AllReduceThen):
        return inner
    inner = optax.with_extra_args_support(inner)
    buckets = strategy_buckets()
    shard = _sharding.config()

    def init(params):
        if shard is not None and shard.stage == 3:  # (fleet.sections._stage3.split_params)
            leaves = jax.tree.leaves(params, is_leaf=_sharding.is_shard)
            if not any(map(_sharding.is_shard, leaves)):
                raise _stage3.refuse("parameters fleet did not split")
            params = _stage3.whole_params(params)
        state = inner.init(params)
        if shard is None:
            return state
        # strategy.sharding: the parameter-shaped state, split over the replicas.
        _shard_probe.verify(inner, params, shard)
        return _sharding.shard_state(state, _sharding.plan(inner.init, params, shard))

    def local_update(grads, state, params=None, **extra):
        """The update in parts (see fleet.sections._sharding.local_update):
        ``core(*args)`` updates the arrays this replica holds (its slices under
        sharding), ``finish`` makes the full parameters, updates and state."""
        _refuse_per_replica_extra(extra, params)
        grads = _prepare(grads)
        if any(map(_sharding.is_shard, jax.tree.leaves(state, is_leaf=_sharding.is_shard))) or (
                _stage3.split_gradients(_sync.current(), grads)):  # (plain SGD's empty state)
            return _sharding.local_update(inner, grads, state, params, **extra)

        def core(g, s, p):
            return inner.update(g, s, p, **extra)

        def finish(updates, new_state, keep=None, *, apply=True):
            if params is None or not apply:
                return None, updates, new_state
            new_params = optax.apply_updates(params, updates)
            if keep is not None:  # check_nan_inf's replay (fleet.sections._finite_replay)
                new_params = _finite_replay.select(keep, new_params, params)
            return new_params, updates, new_state

        return core, (reduce_gradients(grads, buckets), state, params), finish

    def update(grads, state, params=None, **extra):
        core, args, finish = local_update(grads, state, params, **extra)
        return finish(*core(*args), apply=False)[1:]  # (updates, new state)

    tx = AllReduceThen(inner.init if shard is None else init, update)
    tx.inner = inner
    tx.local_update = local_update
    return tx
