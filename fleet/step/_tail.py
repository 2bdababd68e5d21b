"""The end of a step's per-replica body, and its outputs' way out of it.

Moved out of ``fleet.step._program``, whose ``Program.body`` runs the step and
ends here; ``Program.run`` combines what the body returns. The real body's tail
(:func:`leave`): the outputs summed inside (:func:`summed_inside`, with
``check_nan_inf``), their finite flags, the state selected by the chain, the
outputs stacked or replicated; the NNX state the step leaves
(:func:`replicated_state`). The probe's tail (:func:`probe_record`): its
record of what the step did and the undeclared varying scalars it returns; with
the real program's tail behind them when the probe's program may be the real
one (:func:`with_real_tail`, ``fleet.step._first_trace``). Outside the body, the
stacked outputs combined over the replicas (:func:`combined`, :data:`COMBINE`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet._errors import FleetError
from fleet.comm import _sync
from fleet.runtime._leaves import is_key, variables_of
from fleet.runtime._world import DATA_AXIS
from fleet.sections import _finite, _sharding
from fleet.semantics import _outputs, _random_guards
from fleet.step import _first_trace, _roles
from fleet.step._graph import GraphCache, Plan
from fleet.step._record import PlanRecord
from fleet.wrappers._gradient_merge import leave_accumulators

#: The combination over the replicas of each output returned stacked.
COMBINE = {"mean": lambda x: x.mean(0), "sum": lambda x: x.sum(0),
           "max": lambda x: x.max(0), "min": lambda x: x.min(0)}


def summed_inside(plan: Plan, leaves: list, reduces: list) -> list[bool]:
    """With ``check_nan_inf``, which outputs the body sums over the replicas itself
    (a psum), instead of returning them stacked for the mean or sum outside it:
    float32 and float64 ones reduced by ``mean`` or ``sum``. Their finite flags
    are then taken on the sums, the same on every replica, so they need no psum of
    their own to be agreed (on XLA:CPU each array of an all-reduce is a rendezvous
    of every device: one more costs about as much as a small step's compute). A
    sum is non-finite whenever a replica's value is, and it is what the caller
    gets. The sum is the one XLA makes outside (one all-reduce over the same
    values), and the mean divides it as ``jnp.mean`` does: bitwise the same
    outputs. Other dtypes (16-bit floats, which ``jnp.mean`` sums in float32)
    keep the stacked path, and so do ``max`` and ``min`` outputs. ``leaves``:
    the outputs or their dtypes."""
    if not plan.check_nan_inf:
        return [False] * len(leaves)
    return [r in ("mean", "sum") and jnp.result_type(x) in (jnp.float32, jnp.float64)
            for x, r in zip(leaves, reduces)]


def leave(plan: Plan, per_replica: list, trace: Any, recorder: Any, keys: Any, names: list,
          new_state: list, original: list, leaves: list, chain: Any, reduces: list) -> tuple:
    """The body's end: the outputs summed inside, their finite flags, the state
    selected by the chain (check_nan_inf), the outputs stacked or replicated;
    returns the new state, the outputs and (check_nan_inf) the chain."""
    summed = summed_inside(plan, leaves, reduces)
    if any(summed):  # (their flags are then the same on every replica: no agreement)
        sums = iter(_sync.psum([x for x, s in zip(leaves, summed) if s]))
        leaves = [next(sums) if s else x for x, s in zip(leaves, summed)]
    trace.finite.record(names, leaves)
    out_leaves = [x if r == "replicated" or s else (
        x[None] if r in COMBINE or isinstance(r, tuple) else x)
        for x, r, s in zip(leaves, reduces, summed)]
    if plan.check_nan_inf:  # agreed over replicas; old state kept from the first bad call
        chain = _finite.chain_after(_finite.agreed([f for _, f in trace.finite.flags]), chain)
        new_state = recorder.select(chain == 0, new_state, original)
    new_state = [x[None] if pr else x
                 for x, pr in zip(keys.leave(new_state), per_replica)]
    if plan.check_nan_inf:
        return new_state, out_leaves, chain
    return new_state, out_leaves


def probe_record(record: PlanRecord, graph: GraphCache, trace: Any, new_state: list,
                 names: list, leaves: list, reduces: list, treedef: Any) -> list:
    """The probe's record of what the step did, and what its body returns: the
    undeclared varying scalars (for fleet.semantics._outputs), then the state that is
    neither parameters nor optimizer state (for fleet.semantics._outputs.check_counted),
    then the per-example outputs (for fleet.semantics._row_scale).
    The values left typed the same on every replica pass through
    fleet.semantics._random_guards.fleet_mark."""
    marked = [(n, x) for n, x in zip(graph.names, new_state)] + [
        (n, x) for n, x, r in zip(names, leaves, reduces) if r == "replicated"]
    marked = [(n, x) for n, x in marked if not _sync.is_varying(x)]
    _outputs.fleet_declared(*[x for x, r in zip(leaves, reduces)
                              if r not in (_roles.SCALAR, "replicated")])
    if marked:
        _random_guards.fleet_mark(*[x for _, x in marked])
    record.marked = [n for n, _ in marked]
    trace.finite.record(names, leaves)
    record.finite, record.names = [n for n, _ in trace.finite.flags], names
    record.dtypes = [jnp.result_type(x) for x in leaves]
    record.out, record.treedef = reduces, treedef
    record.wrapped_syncs, record.tx_calls = trace.wrapped_syncs, trace.tx.calls
    record.sum_assumed = trace.tx.summed
    record.merge_updates, record.shard_grads = trace.accum.merge_updates, len(trace.shard.grads)
    record.shard_refusals = list(trace.shard.refusals or ())
    record.written = list(trace.written)
    record.counted = [
        i for i, (v, x) in enumerate(zip(graph.variables, new_state))
        if not isinstance(v, (nnx.Param, nnx.OptState)) and not graph.per_replica[i]
        and not is_key(x) and not _sync.is_varying(x)]
    return [jnp.reshape(x, (1, *jnp.shape(x))) for x, r in zip(leaves, reduces)
            if r == _roles.SCALAR] + [
        jax.lax.pcast(new_state[i], DATA_AXIS, to="varying")[None]
        for i in record.counted] + [x for x, r in zip(leaves, reduces) if r == "gather"]


def with_real_tail(plan: Plan, probed: list, tail: Callable, leaves: list, reduces: list,
                   both: dict) -> tuple:
    """The probe's body returns, after ``probed``, the real program's tail on the
    decisions it assumes (each undeclared scalar a mean: most are), its outputs
    grouped by form (``both`` filled: fleet.step._first_trace)."""
    both["outputs"] = len(probed)
    assumed = [r if r != _roles.SCALAR else "mean" for r in reduces]  # (most are)
    both["forms"] = _first_trace.forms(assumed, summed_inside(plan, leaves, assumed),
                                       COMBINE)
    # What the program outside the body assumes (fleet.step._first_trace.speculated):
    # an integer scalar summed (a count), any other a mean.
    both["out"] = [r if r != _roles.SCALAR else "sum" if jnp.issubdtype(
        jnp.result_type(x), jnp.integer) or jnp.result_type(x) == jnp.bool_ else "mean"
        for x, r in zip(leaves, reduces)]
    both["summed"] = summed_inside(plan, leaves, both["out"])
    new_state, out_leaves, *checked = _first_trace.named_tail(lambda: tail(assumed))()
    return (probed, new_state,
            [x for x, f in zip(out_leaves, both["forms"]) if f == _first_trace.REPLICATED],
            [x for x, f in zip(out_leaves, both["forms"]) if f != _first_trace.REPLICATED],
            *checked)


def combined(out_leaves: list, record: PlanRecord, n: int) -> list:
    """The body's outputs combined over the ``n`` replicas, outside it."""
    # Stacked per-replica values are combined here, outside the per-device body,
    # so the body's only collectives are the gradient buckets and buffer means
    # (and, with check_nan_inf, the sums of summed_inside, divided here as
    # jnp.mean divides).
    return [
        (jax.lax.div(x, jnp.asarray(n, x.dtype)) if r == "mean" else x) if s
        else _sharding.Shard(x, r[1]) if isinstance(r, tuple)
        else COMBINE[r](x) if r in COMBINE else x
        for x, r, s in zip(out_leaves, record.out, record.summed)
    ]


def replicated_state(graph: GraphCache, new: Any, plan: Plan, entered: dict,
                     original: list, trace: Any) -> list:
    """The NNX state the step leaves (``trace``: the body's): an nnx.BatchNorm's
    running statistics averaged; a parameter set from per-replica values refused
    (except under no_sync, where the parameters vary by type); any other varying
    state kept as replica 0's, and refused by the probe where it came from the
    batch (fleet.semantics._outputs.check_written)."""
    variables = [v for _, v in variables_of(new)]
    leaves = [v.get_raw_value() for v in variables]
    # Under no_sync the wrapped parameters entered as varying; unchanged, they
    # leave as the invariant values they were.
    leaves = [original[entered[id(x)]] if id(x) in entered else x for x in leaves]
    leave_accumulators(trace, graph.accum_keys, leaves)
    varying = [i for i, x in enumerate(leaves)
               if _sync.is_varying(x) and not graph.per_replica[i]]
    buffers = [i for i in varying if graph.running_stats[i]]
    # (other state first: parameters may vary because of it, as updates scaled by a
    # learning rate set from the replica's loss)
    others = sorted((i for i in varying if i not in buffers),
                    key=lambda i: isinstance(variables[i], nnx.Param))
    params_vary = not plan.no_sync and any(isinstance(variables[i], nnx.Param) for i in others)
    for i in others:
        refusal = _varying_state(graph.names[i], variables[i], plan.no_sync)
        if params_vary:
            raise FleetError(refusal)
        # State set inside a wrapped model's call from the parameters it reads
        # (varying by type there: nnx.SpectralNorm's u and sigma), or from any
        # parameter under no_sync (an EMA of the weights, a target network's
        # copy), is kept as replica 0's; the probe refuses it where it came from
        # the batch (a count, a maximum of the replica's rows).
        trace.written.append(refusal)
        leaves[i] = _sync.fleet_written(leaves[i])
    if buffers:
        for i, x in zip(buffers, _sync.mean_over_replicas([leaves[i] for i in buffers])):
            leaves[i] = x
    return leaves


def _varying_state(name: str, variable: Any, no_sync: bool) -> str:
    """The refusal of state the step leaves different on each replica."""
    if isinstance(variable, nnx.Param):
        hint = (" Under no_sync the gradients are local: update with a "
                "fleet.distributed_optimizer, which does not step inside no_sync." if no_sync
                else " Compute its gradient through a wrapped model (fleet.distributed_model).")
    else:
        hint = (" fleet averages only the running statistics of an nnx.BatchNorm layer (its "
                "mean and var); it cannot tell whether this value is a mean over the "
                "replica's rows, a sum, a count or a maximum. Combine it yourself in the "
                "step, as on one device: fleet.all_reduce(value, 'avg') for a mean, "
                "fleet.all_reduce(value, 'sum') for a sum or a count, "
                "fleet.all_reduce(value, 'max') for a maximum ('min' for a minimum), "
                "fleet.all_gather(value).reshape(-1, ...) for every replica's rows (a queue "
                "of keys); or keep counts and totals in an nnx.metrics metric, which fleet "
                "updates with the global batch.")
    return (f"{name} would hold different values on different replicas after this step "
            f"(it was set from per-replica values).{hint}")
