"""What a plan's probe recorded: :class:`PlanRecord`.

The first trace of a plan probes the step body (fleet.step._program.Program.probe):
a trace that records what the step did -- its outputs' kinds, the gradient syncs,
the optimizer calls, the metrics' scalars -- which the guards check and the real
trace, the decorator and fleet.step._first_trace read. One record per plan
(``Program.records``); a trace that is not the probe (the one-device reference, a
known plan's new shapes) writes into a fresh record that nobody reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class PlanRecord:
    """One plan's record, filled by its probe (fleet.step._tail.probe_record,
    fleet.step._probe_checks.resolve_scalars / resolve_metrics, Program.first_trace)
    and read by its real trace."""

    #: each output's combination over the replicas ("mean", "sum", "max", "min",
    #: "replicated", a gather's tuple; fleet.step._roles.SCALAR until resolved)
    out: list = dataclasses.field(default_factory=list)
    #: per output: the body sums it over the replicas itself (check_nan_inf:
    #: fleet.step._tail.summed_inside)
    summed: list = dataclasses.field(default_factory=list)
    treedef: Any = None  # the outputs' tree structure
    names: list = dataclasses.field(default_factory=list)  # each output's name in messages
    dtypes: list = dataclasses.field(default_factory=list)  # each output's dtype
    #: names of the state and outputs left typed the same on every replica
    #: (fleet.semantics._random_guards.check_typing)
    marked: list = dataclasses.field(default_factory=list)
    #: indices of the state counted from the batch's shape (fleet.semantics._outputs.check_counted)
    counted: list = dataclasses.field(default_factory=list)
    #: names of the parameters a wrapped model's call wrote (fleet.semantics._outputs.check_written)
    written: list = dataclasses.field(default_factory=list)
    finite: list = dataclasses.field(default_factory=list)  # names of check_nan_inf's flags
    wrapped_syncs: int = 0  # buckets of wrapped-model parameters synced
    tx_calls: int = 0  # distributed optimizer updates
    merge_updates: int = 0  # updates of an optimizer that merges gradients (gradient_merge)
    shard_grads: int = 0  # gradients ZeRO's backward left as placeholders (strategy.sharding)
    #: refusals the probe's trace deferred to its checks (fleet.sections._sharding)
    shard_refusals: list = dataclasses.field(default_factory=list)
    #: gradients of raw parameters were summed by JAX: the distributed optimizer divides
    auto_sum: bool = False
    #: the probe's optimizer divided gradients as if JAX had summed them (its program
    #: is the real one where the checks find that JAX did: fleet.step._first_trace)
    sum_assumed: bool = False
    #: the probe's outputs hold gradients the distributed optimizer got (refused
    #: where JAX summed them: fleet.step._probe_checks.check_returned)
    returns_grads: bool = False
    #: which metric got each varying scalar (the probe; fleet.semantics._metrics)
    metric_labels: list = dataclasses.field(default_factory=list)
    #: how the k-th varying scalar a metric got combines (the real trace)
    metric_scalars: list = dataclasses.field(default_factory=list)
    #: how the probe combined each (fleet.semantics._metrics: its program is the real
    #: one where that is what the checks decide)
    metric_assumed: list = dataclasses.field(default_factory=list)
