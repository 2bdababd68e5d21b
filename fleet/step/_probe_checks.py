"""The contract checks of a step's traced program, and the probe's decisions.

``fleet.step._program`` calls them. A plan's first trace reads the probe's jaxpr
(``Program.first_trace``): :func:`check_randomness` refuses the draws fleet
cannot make exact and :func:`check_per_example` the gradients taken per example;
:func:`resolve_scalars` and :func:`resolve_metrics` decide how each undeclared
varying scalar combines over the replicas (and refuse a summed loss and counts
of the replica's rows), :func:`check_row_count` the row count used as more than a
scale before a gradient or an output, and :func:`check_gradients` refuses gradients JAX would
sum, read under sharding or merged without a distributed optimizer. Every trace
of the body (``Program.body``) refuses returned gradients that are not the
single-device ones (:func:`check_returned`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet._errors import FleetError, nth
from fleet.runtime._leaves import dotted
from fleet.runtime._world import world
from fleet.sections import _batch_norm
from fleet.semantics import (
    _gathered,
    _metrics,
    _outputs,
    _per_example,
    _random_guards,
    _row_count,
    _row_mixing,
    _row_scale,
    _summed_loss,
)
from fleet.step import _guards, _roles, _summed_grads
from fleet.step._graph import GraphCache, Plan
from fleet.step._record import PlanRecord
from fleet.step._tail import summed_inside

SHARD_GRADS_READ = (
    "strategy.sharding: the step reads the wrapped model's gradients outside "
    "optimizer.update ({what}). Under sharding each replica holds only its slice of the "
    "reduced gradient, and nnx.grad / jax.grad return placeholders, so a gradient norm, "
    "a returned gradient or a hand-made change would be wrong. Do it in the optax chain "
    "(optax.clip_by_global_norm), or turn strategy.sharding off")


def replica_rows(plan: Plan, batch: list) -> frozenset:
    """The row counts of the batch arguments on one replica."""
    return frozenset(r // plan.mesh.devices.size for r in _roles.rows_of(batch))


def batch_arguments(plan: Plan, batch: list) -> list[tuple[int, str, Any]]:
    """Each batch argument of the call: its position, its name in a message, its value."""
    n_pos = len(plan.kinds) - len(plan.kw_names)
    at = [i for i, k in enumerate(plan.kinds) if k == _roles.BATCH]
    return [(i, nth(i) if i < n_pos else f"keyword argument {plan.kw_names[i - n_pos]!r}", v)
            for i, v in zip(at, batch)]


def batch_names(plan: Plan, batch: list) -> tuple[str, ...]:
    """The name of each batch leaf, in the body's order: its argument, and its path
    in a pytree argument."""
    return tuple(name if not path else f"{name} leaf {dotted(path)!r}"
                 for _, name, value in batch_arguments(plan, batch)
                 for path, _ in jax.tree_util.tree_flatten_with_path(value)[0])


def check_randomness(plan: Plan, jaxpr: Any, reference: Any, batch: list, marked: list) -> None:
    """The probe's draws that fleet cannot make exact, refused (fleet.semantics._random_guards)."""
    n = plan.mesh.devices.size
    rows = replica_rows(plan, batch)
    _random_guards.check_draws(jaxpr, rows, reference if n > 1 else None,
                               frozenset(r * n for r in rows))
    _random_guards.check_typing(jaxpr, rows, marked)


def check_per_example(plan: Plan, graph: GraphCache, jaxpr: Any, batch: list,
                      trees: list, reference: Any) -> None:
    """The probe's per-example gradients, refused (fleet.semantics._per_example);
    on one replica they are the single-device ones."""
    if plan.mesh.devices.size == 1:
        return
    tree_pos = [i for i, k in enumerate(plan.kinds) if k == _roles.TREE]
    named = [(name, v.shape) for name, v in zip(graph.names, graph.variables)] + [
        (f"{nth(tree_pos[i])} leaf {dotted(p)!r}", jnp.shape(x))
        for i, t in enumerate(trees) for p, x in jax.tree_util.tree_flatten_with_path(t)[0]]
    _per_example.check_per_example(jaxpr, replica_rows(plan, batch), named, reference,
                                   plan.mesh.devices.size)


def check_written(plan: Plan, record: PlanRecord, jaxpr: Any) -> None:
    """The parameters a wrapped model's call wrote, refused unless computed from
    replicated values alone (fleet.semantics._outputs.check_written); on one
    replica its value is the single-device one."""
    if record.written and plan.mesh.devices.size > 1:
        _outputs.check_written(jaxpr, record.written)


def check_row_mixing(plan: Plan, graph: GraphCache, jaxpr: Any, args: tuple,
                     reference: Any) -> None:
    """The probe's operations that combine different rows of the batch, refused
    (fleet.semantics._row_mixing), naming an unwrapped BatchNorm in training mode
    where the step has one; on one replica its rows are the global batch.
    ``args``: the body's (state, trees, batch, repl); ``reference``: the
    single-device step's jaxpr."""
    if plan.mesh.devices.size == 1:
        return
    state, trees, batch = args[:3]
    start = len(jax.tree.leaves(state)) + len(jax.tree.leaves(trees))
    synced = world().strategy.sync_batch_norm is not False
    try:
        _row_mixing.check_rows(
            _outputs.shard_body(jaxpr), range(start, start + len(jax.tree.leaves(batch))),
            replica_rows(plan, batch), partial_mixing=synced,
            reference=reference, replicas=plan.mesh.devices.size,
            names=batch_names(plan, batch))
    except FleetError as e:
        hint = synced and _batch_norm.unwrapped_in_training(
            graph.objs, [nth(i) for i in graph.positions])
        if not hint:
            raise
        raise FleetError(str(e) + hint) from None


def resolve_scalars(plan: Plan, record: PlanRecord, graph: GraphCache, jaxpr: Any,
                    reference: Any, scaled: Callable[[], Any]) -> None:
    """Decides how each undeclared varying scalar output combines (the probe's
    :data:`fleet.step._roles.SCALAR`: fleet.semantics._outputs reads it from the probe's trace
    and ``scaled()``, the single-device trace with more rows), then which
    outputs the body sums; refuses a summed loss and state counted from the
    batch's shape (against ``reference``, the single-device step)."""
    at = [i for i, r in enumerate(record.out) if r == _roles.SCALAR]
    replicas = plan.mesh.devices.size
    kinds = _outputs.scalar_reduces(
        jaxpr, scaled() if at else None, max(replicas, 2), [record.names[i] for i in at],
        [record.dtypes[i] for i in at], replicas, bool(record.wrapped_syncs))
    for i, k in zip(at, kinds):
        record.out[i] = k
    if replicas > 1 and record.wrapped_syncs:
        _summed_loss.check_summed_loss(jaxpr, reference, replicas)
    if replicas > 1:  # (on one replica its rows are the global batch's)
        _outputs.check_counted(jaxpr, reference, len(at),
                               [graph.names[i] for i in record.counted])
        _row_scale.check_row_scaled(
            jaxpr, reference, len(at) + len(record.counted),
            [n for n, r in zip(record.names, record.out) if r == "gather"], replicas)
    record.summed = summed_inside(plan, record.dtypes, record.out)


def resolve_metrics(plan: Plan, record: PlanRecord, jaxpr: Any,
                    scaled: Callable[[], Any]) -> None:
    """Decides how each varying scalar a metric's update got combines over the
    replicas (fleet.semantics._metrics), as resolve_scalars does for the outputs."""
    labels = record.metric_labels
    record.metric_scalars = _outputs.metric_reduces(
        jaxpr, scaled() if labels else None, max(plan.mesh.devices.size, 2),
        [_metrics.mark_name(k) for k in range(len(labels))], labels, plan.mesh.devices.size)


def check_row_count(plan: Plan, jaxpr: Any, reference: Any, outputs: list[str]) -> None:
    """The replica's row count reaching a gradient, or one of ``outputs`` (the names
    of the undeclared varying scalars the probe returns first), other than as a
    scale, refused (fleet.semantics._row_count); on one replica its rows are the
    global batch, and ``strategy.sync_batch_norm = False`` uses them on purpose."""
    if plan.mesh.devices.size == 1 or reference is None or world().strategy.sync_batch_norm is False:
        return
    _row_count.check_row_count(_outputs.shard_body(jaxpr), _outputs.shard_body(reference),
                               plan.mesh.devices.size, outputs)


def check_gradients(plan: Plan, record: PlanRecord, graph: GraphCache, jaxpr: Any,
                    trees: list) -> None:
    """The probe's gradients: refused when JAX summed them over the replicas
    (no wrapped model synced them; ``record.auto_sum`` set when a distributed
    optimizer divides them), when the optimizer got others than the backward pass
    left or the step reads them under ``strategy.sharding``,
    and when ``strategy.gradient_merge`` has no distributed optimizer to merge them."""
    strategy = world().strategy
    if _gathered.gathered_alone(jaxpr):
        raise FleetError(_gathered.GATHERED_ALONE.format(n=plan.mesh.devices.size))
    if _guards.foreign_psums(jaxpr):
        summed = _guards.summed_state(jaxpr, plan.kinds, graph.names, trees)
        # Gradients of replicated state that no wrapped model synced: JAX summed
        # them. A distributed optimizer that got them, with no wrapped model in
        # the step, divides them by N (raw parameters, functional optax style).
        cast = record.wrapped_syncs and _guards.all_reduced_casts(jaxpr)
        if cast:
            raise FleetError(_guards.ALL_REDUCED_DIFFERENTIATED.format(
                where=cast[0], n=plan.mesh.devices.size))
        if record.wrapped_syncs or not record.tx_calls:
            unsynced = [name for name, v, synced in zip(
                graph.names, graph.variables, graph.synced)
                if name in summed and isinstance(v, nnx.Param) and not synced]
            raise FleetError(_guards.implicit_sum(
                plan.mesh.devices.size, summed, bool(record.wrapped_syncs),
                unsynced))
        used, returned = _summed_grads.summed_uses(jaxpr)
        if used:
            raise FleetError(_summed_grads.SUMMED_USED.format(n=plan.mesh.devices.size,
                                                              where=", ".join(used)))
        if returned or record.returns_grads:
            raise FleetError(_summed_grads.RETURNED.format(n=plan.mesh.devices.size))
        record.auto_sum = True
        if strategy.amp:
            raise FleetError(
                "strategy.amp sets the computation dtype of a wrapped model's layers, "
                "and this step trains raw parameters (no wrapped model): wrap an NNX "
                "model with fleet.distributed_model, or turn strategy.amp off")
    if record.shard_refusals:  # (deferred by the trace: the cause above comes first)
        raise FleetError(record.shard_refusals[0])
    if record.shard_grads:
        used = _guards.placeholder_uses(jaxpr)
        if used:
            raise FleetError(SHARD_GRADS_READ.format(what=", ".join(used[:3])))
    merge = strategy.gradient_merge_configs
    if (strategy.gradient_merge and merge.k_steps > 1 and record.wrapped_syncs
            and plan.grad_merge is None):
        raise FleetError(
            f"strategy.gradient_merge (k_steps={merge.k_steps}) merges gradients in the "
            "distributed optimizer, and this step differentiates the wrapped model "
            "without one: pass fleet.distributed_optimizer(nnx.Optimizer(model, tx, "
            "wrt=nnx.Param)) to the step and update with it")


def check_returned(trace: Any, out: Any, record: PlanRecord) -> None:
    """The step's outputs hold no gradient the body cannot return as on one
    device: a sharded model's (placeholders) or raw parameters' (summed by JAX).
    The probe, which cannot know yet whether JAX summed them, records whether it
    returns raw parameters' gradients (:func:`check_gradients` refuses them once it
    finds JAX did)."""
    if trace.shard.grads and any(id(x) in trace.shard.grads for x in jax.tree.leaves(out)):
        raise FleetError(SHARD_GRADS_READ.format(what="the step returns them"))
    returned = any(id(x) in trace.tx.grads for x in jax.tree.leaves(out))
    if trace.tx.auto_sum and returned:
        raise FleetError(_summed_grads.RETURNED.format(n=trace.num_replicas))
    if trace.tx.assume_sum:
        record.returns_grads = returned
