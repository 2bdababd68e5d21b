"""The traced program of a step: what ``jit`` compiles for one :class:`Plan`.

:meth:`Program.run` is the global program: the step's function runs once per
replica (``jax.shard_map`` over ``data``, ``check_vma=True``) in :meth:`Program.body`,
and the per-replica outputs are combined outside it (mean, sum, gather), so the
body's only collectives are the gradient buckets and the buffers' means (and,
with ``check_nan_inf``, the float outputs' sums and the agreement of the other
finite flags: the body selects the state it leaves, :mod:`fleet.sections._finite`,
``fleet.step._tail.summed_inside``). The first trace of a plan probes the
body (a trace that records what it did: the outputs' kinds, the gradient syncs,
the optimizer calls) and checks the step against the contract
(``fleet.step._guards``, ``fleet.step._probe_checks``) before the real program
runs; the probe's body holds the real program's tail, so the probe's program is,
most often, the real one (``fleet.step._first_trace``: a first call traces the
step twice, the one-device reference and the probe).

This module holds the global program, its first trace and the per-replica body up
to the step's outputs; the body's end, its state and the outputs' combination are
in ``fleet.step._tail``, the checks made from the probe in ``fleet.step._probe_checks``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from fleet._errors import FleetError, SummedLossError
from fleet.comm import _sync, _trace
from fleet.runtime._leaves import dotted
from fleet.runtime._world import DATA_AXIS
from fleet.sections import _finite_replay
from fleet.semantics import _metrics, _random, _trace_errors
from fleet.semantics._row_mixing import tables_hint
from fleet.step import _first_trace, _guards, _hints, _roles
from fleet.step._graph import GraphCache, Plan, restructured, tree_layout, tree_rows
from fleet.step._probe_checks import (
    batch_arguments,
    check_gradients,
    check_per_example,
    check_randomness,
    check_returned,
    check_row_count,
    check_row_mixing,
    check_written,
    replica_rows,
    resolve_metrics,
    resolve_scalars,
)
from fleet.step._record import PlanRecord
from fleet.step._tail import COMBINE, combined, leave, probe_record, replicated_state, with_real_tail
from fleet.wrappers._distributed_optimizer import enter_trace
from fleet.wrappers._gradient_merge import check_one_sum_each


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
        # A first trace whose checks run while XLA compiles (fleet.step._jitted): the
        # plan traced so, its checks still to run, and the plans whose next trace
        # is the real one (the probe's program to evaluate again, or None).
        self.speculating: Plan | None = None
        self.pending: dict[Plan, Callable] = {}
        self.again: dict[Plan, tuple | None] = {}

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
        if record is None and self.speculating is plan:  # checked later (fleet.step._jitted)
            record, first = self.speculate(plan, args, specs, state_specs, trees, batch)
        elif record is None:
            record, first = self.first_trace(plan, args, specs, state_specs, trees, batch)
            self.records[plan] = record
        elif plan in self.again:  # a speculated first trace whose program was not the real one
            probed = self.again.pop(plan)
            if probed is not None:  # only the combination outside the body differed
                first = _first_trace.evaluated(*probed, args, self.forms(record))
        else:  # a known plan's new shapes are checked on one device too
            self.replay(plan, args, specs)
        self.trace_count += self.speculating is not plan
        if first is not None:  # the probe's program is the real one (fleet.step._first_trace)
            new_state, out_leaves, checked = first
        else:
            new_state, out_leaves, *checked = jax.shard_map(
                self.bound_body(plan, record=record, probe=False),
                mesh=plan.mesh, in_specs=specs, out_specs=self.out_specs(plan, record, state_specs),
                check_vma=True,
            )(*args)
        out_leaves = combined(out_leaves, record, plan.mesh.devices.size)  # (fleet.step._tail)
        out = jax.tree_util.tree_unflatten(record.treedef, out_leaves)
        return new_state, out, (checked[0] if checked else chain)

    def first_trace(self, plan: Plan, args: tuple, specs: tuple, state_specs: list,
                    trees: list, batch: list) -> tuple[PlanRecord, tuple | None]:
        """A plan's first trace: the one-device reference, then the probe, which
        checks the step (fleet.step._guards) and records what it did. Returns the
        record and, when the probe's program is the real one (fleet.step._first_trace),
        its new state, outputs (in order) and chain (a list, empty without
        check_nan_inf); else ``None``."""
        probe_body, reference = self.replay(plan, args, specs)
        record, both = PlanRecord(), {}
        closed, shape = self.probe(plan, record, args, specs, state_specs, both)
        self.check_probe(plan, record, closed, both, (probe_body, reference, args, specs,
                                                      trees, batch))
        decided = self.forms(record)
        if not _first_trace.reusable(record, both["forms"], decided):
            return record, None
        return record, _first_trace.evaluated(closed, shape, args, decided)

    @staticmethod
    def forms(record: PlanRecord) -> list[str]:
        """How each output leaves the body, as the record decided."""
        return _first_trace.forms(record.out, record.summed, COMBINE)

    def check_probe(self, plan: Plan, record: PlanRecord, closed: Any, both: dict,
                    traced: tuple) -> None:
        """The guards on the probe's jaxpr (``record``'s decisions made);
        ``traced``: the reference's body and trace, the arguments, their specs,
        the trees and the batch."""
        probe_body, reference, args, specs, trees, batch = traced
        jaxpr = _first_trace.probe_view(closed, both["outputs"])
        undeclared = [name for name, r in zip(record.names, record.out) if r == _roles.SCALAR]
        check_randomness(plan, jaxpr, reference, batch, record.marked)
        check_per_example(plan, self.graph, jaxpr, batch, trees, reference)
        check_written(plan, record, jaxpr)  # (state from the batch: before what counts it)
        scaled = _first_trace.scaled_reference(plan, reference, probe_body, args, specs)
        try:
            resolve_scalars(plan, record, self.graph, jaxpr, reference, scaled)
            resolve_metrics(plan, record, jaxpr, scaled)
        except SummedLossError:  # rows mixed too (a softmax over the batch): no reduction mends that
            check_row_mixing(plan, self.graph, jaxpr, args, reference)
            raise
        except FleetError as e:  # (an output no combination gives: its rows from a table?)
            hint = tables_hint(replica_rows(plan, batch))
            if not hint:
                raise
            raise type(e)(str(e) + hint).with_traceback(e.__traceback__) from e.__cause__
        check_row_mixing(plan, self.graph, jaxpr, args, reference)  # (after the outputs' own refusals)
        check_gradients(plan, record, self.graph, jaxpr, trees)
        check_row_count(plan, jaxpr, reference, undeclared)  # (after the others' refusals)

    def speculate(self, plan: Plan, args: tuple, specs: tuple, state_specs: list,
                  trees: list, batch: list) -> tuple[PlanRecord, tuple]:
        """A plan's first trace with its checks deferred (fleet.step._jitted compiles
        meanwhile): the probe, whose program is returned as the real one on the
        decisions it assumed (a record holding them). The reference and the guards
        wait in :attr:`pending` for :meth:`settle`. A probe that fails raises the
        reference's error first, as when the reference was traced first."""
        _guards.check_closures(self.fn)
        record, both = PlanRecord(), {}
        failed = None
        try:
            closed, shape = self.probe(plan, record, args, specs, state_specs, both)
        except Exception as e:  # noqa: BLE001 (raised below, after the reference's)
            failed = e
        if failed is not None:  # (outside the except: the reference's error stands alone)
            self.replay(plan, args, specs)
            if isinstance(failed, FleetError) or not batch:
                raise failed
            raise _split_failure(failed, plan, batch) from None

        def check() -> tuple:
            probe_body, reference = self.replay(plan, args, specs)
            self.check_probe(plan, record, closed, both, (probe_body, reference, args, specs,
                                                          trees, batch))
            return record, both, (closed, shape)

        self.pending[plan] = check
        assumed = dataclasses.replace(record, out=both["out"], summed=both["summed"])
        return assumed, _first_trace.evaluated(closed, shape, args, both["forms"])

    def settle(self, plan: Plan) -> bool:
        """A speculated first trace's reference and guards (their errors raised);
        whether its program is the real one. If not, the plan's next trace is the
        real one: the probe's program evaluated again with the decisions made
        (when only the combination outside the body differed), else the step's
        trace (fleet.step._first_trace)."""
        record, both, probed = self.pending.pop(plan)()
        self.records[plan] = record
        decided = self.forms(record)
        reusable = _first_trace.reusable(record, both["forms"], decided)
        if reusable and (record.out, record.summed) == (both["out"], both["summed"]):
            self.trace_count += 1
            return True
        self.again[plan] = probed if reusable else None
        return False

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
                self.bound_body(plan, record=into, probe=True, both=real),
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

    def bound_body(self, plan: Plan, **kwargs: Any) -> Callable:
        """:meth:`body` for ``plan`` as JAX traces it (jax 0.10 prints a partial to name a trace)."""
        def fleet_step_body(*args: Any) -> Any:
            return self.body(plan, *args, **kwargs)

        return fleet_step_body

    def body(self, plan: Plan, state, trees, batch, repl, chain=None, *, record, probe,
             both=None):
        """One replica's step: its state, trees, batch rows and replicated values
        entered, the step run under the call's trace, its new state and outputs
        checked; returns the tail's (fleet.step._tail.leave) or, for the probe,
        its record's outputs (with the real tail's when ``both`` is given)."""
        per_replica = self.graph.per_replica
        state = [x[0] if pr else x for x, pr in zip(state, per_replica)]
        if plan.tree_shards is not None:
            trees = tree_rows(trees)
        rows = _roles.rows_of(batch)
        keys = _random.Keys(rows)  # each replica draws its rows' bits
        state = keys.enter(state, self.graph.optimizer_held)
        trees, repl = keys.enter(trees), keys.enter(repl)
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
        trace, recorder = self.new_trace(plan, record, state, objs, probe)
        tree_variables = _roles.tree_variables(values, plan.kinds)
        with _sync.tracing(trace):
            with _metrics.global_updates(trace, objs if self.graph.metrics else (), rows, record, probe):
                out = keys.leave(self.fn(*values[:n_pos],
                                         **dict(zip(plan.kw_names, values[n_pos:]))))
            _roles.check_tree_writes(tree_variables, values, plan.kw_names)
            graphdef, new = nnx.split(objs)
            if graphdef != plan.graphdef:
                raise FleetError(restructured(objs))
            new_state = replicated_state(self.graph, new, plan, entered, original, trace)
            leaves, reduces, treedef = _roles.combine_outputs(out, batch, self.out_reduce)
        check_returned(trace, out, record)
        names = [(f"output {dotted(p)}" if dotted(p) else "the output") for p in
                 [q for q, _ in jax.tree_util.tree_flatten_with_path(out)[0]]]
        tail = functools.partial(leave, plan, per_replica, trace, recorder, keys, names,
                                 new_state, original, leaves, chain)
        if not probe:
            return tail(record.out)  # (the probe's, each scalar's combination decided)
        # The probe returns the undeclared varying scalars, for fleet.semantics._outputs
        n_finite = len(trace.finite.flags)
        probed = probe_record(record, self.graph, trace, new_state, names, leaves, reduces,
                              treedef)
        if both is None:
            return probed
        del trace.finite.flags[n_finite:]  # (the tail records the outputs' flags itself)
        return with_real_tail(plan, probed, tail, leaves, reduces, both)

    def new_trace(self, plan: Plan, record: PlanRecord, state: list, objs: Any,
                  probe: bool) -> tuple:
        """The body's :class:`fleet.comm._trace.SyncTrace`, entered by the NNX
        objects' distributed optimizers, and (check_nan_inf) its finite recorder.
        The probe's defers ZeRO's refusals to its checks."""
        trace = _trace.SyncTrace(num_replicas=plan.mesh.devices.size)
        trace.shard.refusals = [] if probe else None
        trace.accum.no_sync, trace.tx.auto_sum = plan.no_sync, record.auto_sum
        trace.tx.assume_sum = probe
        trace.finite.check = plan.check_nan_inf
        check_one_sum_each(self.graph.accum_keys, objs)
        trace.accum.given = {k: x for k, x in zip(self.graph.accum_keys, state) if k is not None}
        enter_trace(trace, objs, grad_merge=plan.grad_merge, sharded=plan.sharded,
                    replicas=plan.mesh.devices.size)
        recorder = trace.finite.recorder = _finite_replay.Recorder() if plan.check_nan_inf else None
        return trace, recorder

    def replay(self, plan: Plan, args: tuple, specs: tuple) -> tuple[Callable, Any]:
        """The checks of every trace (a plan's first, and its new shapes): the step's
        closures, and the step traced as the single-device step
        (fleet.step._guards.check_on_one_device), whose error says so when the step
        holds a copy of the model made before the wrapping. Returns the probe's body
        it ran and the reference."""
        _guards.check_closures(self.fn)
        probe_body = self.bound_body(plan, record=PlanRecord(), probe=True)
        try:
            return probe_body, _guards.check_on_one_device(
                probe_body, plan.mesh, args, specs,
                scalars=_hints.scalar_names(self.fn, plan.kinds, plan.kw_names, _roles.REPL))
        except FleetError as e:
            e = _first_trace.with_copies_hint(e, self.graph.objs)
            raise _hints.with_bound_hint(e, self.fn) from e.__cause__


def _split_failure(error: Exception, plan: Plan, batch: list) -> FleetError:
    """The error for a step whose single-device trace succeeded and whose
    per-replica trace raised ``error``: the batch arguments it split, named."""
    split = batch_arguments(plan, batch)
    return _trace_errors.split_failure(
        error, [(name, [tuple(x.shape) for x in jax.tree.leaves(v)]) for _, name, v in split],
        plan.mesh.devices.size,
        tuple(i for i, _, _ in split if i < len(plan.kinds) - len(plan.kw_names)))
