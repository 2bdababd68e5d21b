"""The traced program of a step: what ``jit`` compiles for one :class:`Plan`.

:meth:`Program.run` is the global program: the step's function runs once per
replica (``jax.shard_map`` over ``data``, ``check_vma=True``) in :meth:`Program.body`,
and the per-replica outputs are combined outside it (mean, sum, gather), so the
body's only collectives are the gradient buckets and the buffers' means (and,
with ``check_nan_inf``, the float outputs' sums and the agreement of the other
finite flags: the body selects the state it leaves, :mod:`fleet.sections._finite`,
:func:`summed_inside`). The first trace of a plan probes the
body (a trace that records what it did: the outputs' kinds, the gradient syncs,
the optimizer calls) and checks the step against the contract
(``fleet.step._guards``) before the real program runs; the probe's body holds
the real program's tail, so the probe's program is, most often, the real one
(``fleet.step._first_trace``: a first call traces the step twice, the one-device
reference and the probe).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from fleet._errors import FleetError
from fleet.comm import _sync, _trace
from fleet.runtime._leaves import dotted, is_key
from fleet.runtime._world import DATA_AXIS, world
from fleet.sections import _finite, _sharding
from fleet.semantics import _metrics, _outputs, _random, _random_guards, _trace_errors
from fleet.step import _first_trace, _guards, _roles
from fleet.step._graph import GraphCache, Plan, is_buffer, tree_layout, tree_rows
from fleet.step._record import PlanRecord
from fleet.wrappers._distributed_optimizer import enter_trace, leave_accumulators

_SHARD_GRADS_READ = (
    "strategy.sharding: the step reads the wrapped model's gradients outside "
    "optimizer.update ({what}). Under sharding each replica holds only its slice of the "
    "reduced gradient, and nnx.grad / jax.grad return placeholders, so a gradient norm, "
    "a returned gradient or a hand-made change would be wrong. Do it in the optax chain "
    "(optax.clip_by_global_norm), or turn strategy.sharding off")


class Program:
    """A step's function, traced: ``fn`` with its ``out_reduce``, the graph of the
    NNX objects it gets (:class:`GraphCache`, set by the step before a trace) and
    each plan's record from its probe."""

    def __init__(self, fn: Callable, out_reduce: Any):
        self.fn = fn
        self.out_reduce = out_reduce
        self.graph: GraphCache | None = None
        self.records: dict[Plan, PlanRecord] = {}
        self.trace_count = 0  # how often the body was traced for real (tests read it)

    def run(self, plan: Plan, state, trees, batch, repl, chain=None):
        """The global program (``jit`` traces it): the per-replica body under
        ``shard_map``, its outputs combined. Each trace checks the step on one
        device (new shapes too); a plan's first probes the body (fleet.step._guards).
        Returns the new state, the outputs, and the chain: with ``check_nan_inf``
        the one this call leaves (the state is selected on the device:
        fleet.sections._finite), else the one given (``None``)."""
        state_specs = [P(DATA_AXIS) if pr else P() for pr in self.graph.per_replica]
        tree_specs = P() if plan.tree_shards is None else tree_layout(
            plan.tree_shards, P(DATA_AXIS), P())
        specs = (state_specs, tree_specs, P(DATA_AXIS), P())
        args = (state, trees, batch, repl)
        if plan.check_nan_inf:  # the chain goes in: the body selects the state
            specs, args = (*specs, P()), (*args, chain)
        record = self.records.get(plan)
        first = None
        if record is None:
            record, first = self.first_trace(plan, args, specs, state_specs, trees, batch)
            self.records[plan] = record
        else:  # a known plan's new shapes are checked on one device too
            self.replay(plan, args, specs)
        self.trace_count += 1
        if first is not None:  # the probe's program is the real one (fleet.step._first_trace)
            new_state, out_leaves, checked = first
        else:
            new_state, out_leaves, *checked = jax.shard_map(
                functools.partial(self.body, plan, record=record, probe=False),
                mesh=plan.mesh, in_specs=specs, out_specs=self.out_specs(plan, record, state_specs),
                check_vma=True,
            )(*args)
        # Stacked per-replica values are combined here, outside the per-device body,
        # so the body's only collectives are the gradient buckets and buffer means
        # (and, with check_nan_inf, the sums of summed_inside, divided here as
        # jnp.mean divides).
        n = plan.mesh.devices.size
        out_leaves = [
            (jax.lax.div(x, jnp.asarray(n, x.dtype)) if r == "mean" else x) if s
            else _sharding.Shard(x, r[1]) if isinstance(r, tuple)
            else _COMBINE[r](x) if r in _COMBINE else x
            for x, r, s in zip(out_leaves, record.out, record.summed)
        ]
        out = jax.tree_util.tree_unflatten(record.treedef, out_leaves)
        return new_state, out, (checked[0] if checked else chain)

    def first_trace(self, plan: Plan, args: tuple, specs: tuple, state_specs: list,
                    trees: list, batch: list) -> tuple[PlanRecord, tuple | None]:
        """A plan's first trace: the one-device reference, then the probe, which
        checks the step (fleet.step._guards) and records what it did. Returns the
        record and, when the probe's program is the real one (fleet.step._first_trace),
        its new state, outputs (in order) and chain (a list, empty without
        check_nan_inf); else ``None``."""
        strategy = world().strategy
        probe_body, reference = self.replay(plan, args, specs)
        record, both = PlanRecord(), {}
        closed, shape = self.probe(plan, record, args, specs, state_specs, both)
        jaxpr = _first_trace.probe_view(closed, both["outputs"])
        check_randomness(plan, jaxpr, reference, batch, record.marked)
        scaled = _first_trace.scaled_reference(plan, reference, probe_body, args, specs)
        self.resolve_scalars(plan, record, jaxpr, reference, scaled)
        self.resolve_metrics(plan, record, jaxpr, scaled)
        if _guards.foreign_psums(jaxpr):
            summed = _guards.summed_state(jaxpr, plan.kinds, self.graph.names, trees)
            # Gradients of replicated state that no wrapped model synced: JAX summed
            # them. A distributed optimizer that got them, with no wrapped model in
            # the step, divides them by N (raw parameters, functional optax style).
            if record.wrapped_syncs or not record.tx_calls:
                unsynced = [name for name, v, synced in zip(
                    self.graph.names, self.graph.variables, self.graph.synced)
                    if name in summed and isinstance(v, nnx.Param) and not synced]
                raise FleetError(_guards.implicit_sum(
                    plan.mesh.devices.size, summed, bool(record.wrapped_syncs),
                    unsynced))
            record.auto_sum = True
            if strategy.amp:
                raise FleetError(
                    "strategy.amp sets the computation dtype of a wrapped model's layers, "
                    "and this step trains raw parameters (no wrapped model): wrap an NNX "
                    "model with fleet.distributed_model, or turn strategy.amp off")
        if record.shard_grads:
            used = _guards.placeholder_uses(jaxpr)
            if used:
                raise FleetError(_SHARD_GRADS_READ.format(what=", ".join(used[:3])))
        merge = strategy.gradient_merge_configs
        if (strategy.gradient_merge and merge.k_steps > 1 and record.wrapped_syncs
                and plan.grad_merge is None):
            raise FleetError(
                f"strategy.gradient_merge (k_steps={merge.k_steps}) merges gradients in the "
                "distributed optimizer, and this step differentiates the wrapped model "
                "without one: pass fleet.distributed_optimizer(nnx.Optimizer(model, tx, "
                "wrt=nnx.Param)) to the step and update with it")
        decided = _first_trace.forms(record.out, record.summed, _COMBINE)
        if not _first_trace.reusable(record, both["forms"], decided):
            return record, None
        new_state, replicated, rest, *checked = _first_trace.evaluate(closed, shape, args)
        return record, (new_state, _first_trace.ungroup(replicated, rest, decided), checked)

    def out_specs(self, plan: Plan, record: PlanRecord, state_specs: list) -> tuple:
        """The real body's out_specs: the state's, each output's (the chain's)."""
        out_specs = (state_specs, [P() if r == "replicated" or s else P(DATA_AXIS)
                                   for r, s in zip(record.out, record.summed)])
        if plan.check_nan_inf:  # the chain: agreed over the replicas
            out_specs = (*out_specs, P())
        return out_specs

    def probe(self, plan: Plan, record: PlanRecord, args: tuple, specs: tuple, state_specs: list,
              both: dict) -> tuple[Any, Any]:
        """The jaxpr of the body's probe (``record`` filled), with the real
        program's tail (``both`` filled: fleet.step._first_trace), and its output
        shapes. A trace that fails on JAX's replica typing alone (it traces
        untyped) raises the error :func:`fleet.semantics._trace_errors.typing_failure`
        makes of it."""
        def traced(check_vma: bool, into: PlanRecord, real: dict | None) -> Any:
            out_specs = P(DATA_AXIS)  # (the probe returns the undeclared scalars)
            if real is not None:  # then the new state, the outputs by spec, the chain
                out_specs = (out_specs, state_specs, P(), P(DATA_AXIS),
                             *([P()] if plan.check_nan_inf else []))
            return jax.make_jaxpr(jax.shard_map(
                functools.partial(self.body, plan, record=into, probe=True, both=real),
                mesh=plan.mesh, in_specs=specs, out_specs=out_specs,
                check_vma=check_vma), return_shape=True)(*args)

        try:
            return traced(True, record, both)
        except FleetError:
            raise
        except Exception as e:
            typing = _trace_errors.typing_failure(e, lambda: traced(False, PlanRecord(), None)[0])
            if typing is None:
                raise
            raise typing from None

    def body(self, plan: Plan, state, trees, batch, repl, chain=None, *, record, probe,
             both=None):
        per_replica = self.graph.per_replica
        state = [x[0] if pr else x for x, pr in zip(state, per_replica)]
        if plan.tree_shards is not None:
            trees = tree_rows(trees)
        rows = _roles.rows_of(batch)
        keys = _random.Keys(rows)  # each replica draws its rows' bits
        state, trees, repl = keys.enter(state), keys.enter(trees), keys.enter(repl)
        original = state
        if plan.no_sync:  # local gradients: the wrapped parameters vary inside no_sync
            state = [jax.lax.pcast(x, DATA_AXIS, to="varying") if synced else x
                     for x, synced in zip(state, self.graph.synced)]
        objs = nnx.merge(plan.graphdef, jax.tree_util.tree_unflatten(plan.state_treedef, state))
        entered = {id(x): i for i, (x, synced) in enumerate(zip(state, self.graph.synced))
                   if synced and plan.no_sync}
        sources = {_roles.NNX: iter(objs), _roles.TREE: iter(trees), _roles.BATCH: iter(batch),
                   _roles.REPL: iter(repl), _roles.STATIC: iter(plan.statics)}
        values = [next(sources[k]) for k in plan.kinds]
        n_pos = len(values) - len(plan.kw_names)
        trace = _trace.SyncTrace(num_replicas=plan.mesh.devices.size)
        trace.accum.no_sync, trace.tx.auto_sum = plan.no_sync, record.auto_sum
        trace.finite.check = plan.check_nan_inf
        trace.accum.given = {k: x for k, x in zip(self.graph.accum_keys, state) if k is not None}
        enter_trace(trace, objs, grad_merge=plan.grad_merge, sharded=plan.sharded,
                    replicas=plan.mesh.devices.size)
        recorder = trace.finite.recorder = _finite.Recorder() if plan.check_nan_inf else None
        with _sync.tracing(trace):
            with _metrics.global_updates(trace, objs, rows, record, probe):  # global batch
                out = keys.leave(self.fn(*values[:n_pos],
                                         **dict(zip(plan.kw_names, values[n_pos:]))))
            graphdef, new = nnx.split(objs)
            if graphdef != plan.graphdef:
                raise FleetError(
                    "the step changed the structure of an NNX object (added or removed a "
                    "variable or sub-module); build the whole model before training"
                )
            new_state = self.replicated_state(new, plan, entered, original)
            leaves, reduces, treedef = _roles.combine_outputs(out, batch, self.out_reduce)
        if trace.shard.grads and any(id(x) in trace.shard.grads for x in jax.tree.leaves(out)):
            raise FleetError(_SHARD_GRADS_READ.format(what="the step returns them"))
        if trace.tx.auto_sum and any(id(x) in trace.tx.grads for x in jax.tree.leaves(out)):
            raise FleetError(
                "the step returns gradients of raw parameters, which JAX summed over the "
                f"{trace.num_replicas} replicas; wrap the model (fleet.distributed_model) to "
                "get averaged gradients back from a step"
            )
        names = [(f"output {dotted(p)}" if dotted(p) else "the output") for p in
                 [q for q, _ in jax.tree_util.tree_flatten_with_path(out)[0]]]
        tail = functools.partial(self.leave, plan, trace, recorder, keys, names, new_state,
                                 original, leaves, chain)
        if not probe:
            return tail(record.out)  # (the probe's, each scalar's combination decided)
        # The probe returns the undeclared varying scalars, for fleet.semantics._outputs
        n_finite = len(trace.finite.flags)
        probed = self.probe_record(record, trace, new_state, names, leaves, reduces, treedef)
        if both is None:
            return probed
        del trace.finite.flags[n_finite:]  # (the tail records the outputs' flags itself)
        both["outputs"] = len(probed)
        assumed = [r if r != _roles.SCALAR else "mean" for r in reduces]  # (most are)
        both["forms"] = _first_trace.forms(assumed, summed_inside(plan, leaves, assumed),
                                           _COMBINE)
        new_state, out_leaves, *checked = _first_trace.named_tail(lambda: tail(assumed))()
        return (probed, new_state,
                [x for x, f in zip(out_leaves, both["forms"]) if f == _first_trace.REPLICATED],
                [x for x, f in zip(out_leaves, both["forms"]) if f != _first_trace.REPLICATED],
                *checked)

    def leave(self, plan: Plan, trace: Any, recorder: Any, keys: Any, names: list,
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
            x[None] if r in _COMBINE or isinstance(r, tuple) else x)
            for x, r, s in zip(leaves, reduces, summed)]
        if plan.check_nan_inf:  # agreed over replicas; old state kept from the first bad call
            chain = _finite.chain_after(_finite.agreed([f for _, f in trace.finite.flags]), chain)
            new_state = recorder.select(chain == 0, new_state, original)
        new_state = [x[None] if pr else x
                     for x, pr in zip(keys.leave(new_state), self.graph.per_replica)]
        if plan.check_nan_inf:
            return new_state, out_leaves, chain
        return new_state, out_leaves

    def replay(self, plan: Plan, args: tuple, specs: tuple) -> tuple[Callable, Any]:
        """The checks of every trace (a plan's first, and its new shapes): the step's
        closures, and the step traced as the single-device step
        (fleet.step._guards.check_on_one_device), whose error says so when the step
        holds a copy of the model made before the wrapping. Returns the probe's body
        it ran and the reference."""
        _guards.check_closures(self.fn)
        probe_body = functools.partial(self.body, plan, record=PlanRecord(), probe=True)
        try:
            return probe_body, _guards.check_on_one_device(probe_body, plan.mesh, args, specs)
        except FleetError as e:
            raise _first_trace.with_copies_hint(e, self.graph.objs) from e.__cause__

    def probe_record(self, record: PlanRecord, trace: Any, new_state: list, names: list,
                     leaves: list, reduces: list, treedef: Any) -> list:
        """The probe's record of what the step did, and what its body returns: the
        undeclared varying scalars (for fleet.semantics._outputs), then the state that is
        neither parameters nor optimizer state (for fleet.semantics._outputs.check_counted).
        The values left typed the same on every replica pass through
        fleet.semantics._random_guards.fleet_mark."""
        marked = [(n, x) for n, x in zip(self.graph.names, new_state)] + [
            (n, x) for n, x, r in zip(names, leaves, reduces) if r == "replicated"]
        marked = [(n, x) for n, x in marked if not _sync.is_varying(x)]
        _outputs.fleet_declared(*[x for x, r in zip(leaves, reduces)
                                  if r not in (_roles.SCALAR, "replicated")])
        for _, x in marked:
            _random_guards.fleet_mark(x)
        record.marked = [n for n, _ in marked]
        trace.finite.record(names, leaves)
        record.finite, record.names = [n for n, _ in trace.finite.flags], names
        record.dtypes = [jnp.result_type(x) for x in leaves]
        record.out, record.treedef = reduces, treedef
        record.wrapped_syncs, record.tx_calls = trace.wrapped_syncs, trace.tx.calls
        record.merge_updates, record.shard_grads = trace.accum.merge_updates, len(trace.shard.grads)
        record.counted = [
            i for i, (v, x) in enumerate(zip(self.graph.variables, new_state))
            if not isinstance(v, (nnx.Param, nnx.OptState)) and not self.graph.per_replica[i]
            and not is_key(x) and not _sync.is_varying(x)]
        return [jnp.reshape(x, (1,)) for x, r in zip(leaves, reduces) if r == _roles.SCALAR] + [
            jax.lax.pcast(new_state[i], DATA_AXIS, to="varying")[None]
            for i in record.counted]

    def resolve_scalars(self, plan: Plan, record: PlanRecord, jaxpr: Any, reference: Any,
                        scaled: Callable[[], Any]) -> None:
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
            _outputs.check_summed_loss(jaxpr, reference, replicas)
        if replicas > 1:  # (on one replica its rows are the global batch's)
            _outputs.check_counted(jaxpr, reference, len(at),
                                   [self.graph.names[i] for i in record.counted])
        record.summed = summed_inside(plan, record.dtypes, record.out)

    def resolve_metrics(self, plan: Plan, record: PlanRecord, jaxpr: Any,
                        scaled: Callable[[], Any]) -> None:
        """Decides how each varying scalar a metric's update got combines over the
        replicas (fleet.semantics._metrics), as resolve_scalars does for the outputs."""
        labels = record.metric_labels
        record.metric_scalars = _outputs.metric_reduces(
            jaxpr, scaled() if labels else None, max(plan.mesh.devices.size, 2),
            [_metrics.mark_name(k) for k in range(len(labels))], labels)

    def replicated_state(self, new: Any, plan: Plan, entered: dict, original: list) -> list:
        """The NNX state the step leaves: batch-norm statistics averaged, anything
        else varying refused."""
        variables = jax.tree_util.tree_leaves(new, is_leaf=lambda v: isinstance(v, nnx.Variable))
        leaves = [v.get_raw_value() for v in variables]
        # Under no_sync the wrapped parameters entered as varying; unchanged, they
        # leave as the invariant values they were.
        leaves = [original[entered[id(x)]] if id(x) in entered else x for x in leaves]
        leave_accumulators(_sync.current(), self.graph.accum_keys, leaves)
        buffers = [i for i, x in enumerate(leaves)
                   if _sync.is_varying(x) and not self.graph.per_replica[i]]
        for i in buffers:
            if not is_buffer(variables[i]):
                hint = (
                    " Under no_sync the gradients are local: update with a "
                    "fleet.distributed_optimizer, which does not step inside no_sync."
                    if plan.no_sync else
                    " Compute its gradient through a wrapped model (fleet.distributed_model)."
                    if isinstance(variables[i], nnx.Param) else
                    " fleet averages only batch-norm statistics (nnx.BatchStat); it cannot "
                    "tell whether this value is a mean over the replica's rows or a sum. "
                    "Combine it yourself in the step, as on one device: "
                    "fleet.all_reduce(value, 'avg') for a mean, fleet.all_reduce(value, "
                    "'sum') for a sum; or keep counts and totals in an nnx.metrics metric, "
                    "which fleet updates with the global batch."
                )
                raise FleetError(
                    f"{self.graph.names[i]} would hold different values on different "
                    f"replicas after this step (it was set from per-replica values).{hint}"
                )
        if buffers:
            for i, x in zip(buffers, _sync.mean_over_replicas([leaves[i] for i in buffers])):
                leaves[i] = x
        return leaves


def check_randomness(plan: Plan, jaxpr: Any, reference: Any, batch: list, marked: list) -> None:
    """The probe's draws that fleet cannot make exact, refused (fleet.semantics._random_guards)."""
    n = plan.mesh.devices.size
    rows = frozenset(r // n for r in _roles.rows_of(batch))
    _random_guards.check_draws(jaxpr, rows, reference if n > 1 else None,
                               frozenset(r * n for r in rows))
    _random_guards.check_typing(jaxpr, rows, marked)


#: The combination over the replicas of each output returned stacked.
_COMBINE = {"mean": lambda x: x.mean(0), "sum": lambda x: x.sum(0),
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
