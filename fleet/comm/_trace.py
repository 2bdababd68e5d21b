"""The bookkeeping of one trace of a step body: :class:`SyncTrace`.

One object per trace (fleet.step._program.Program.body makes it; the code the
step calls reaches it through :func:`fleet.comm._sync.current`, the one
thread-local stack; what else a trace needs lives here too: check_nan_inf's
Recorder, the metrics' Updates). Its state is grouped by the feature that owns it, each a
small record with the methods that feature calls:

- :class:`Accumulation` (``trace.accum``): ``no_sync``'s accumulated gradients
  and gradient merge's count of updates;
- :class:`OptimizerCalls` (``trace.tx``): the distributed optimizer's updates and
  the scaling of the synced gradients (float16 amp's loss scale, merge's average);
- :class:`ShardGrads` (``trace.shard``): ZeRO's (``strategy.sharding``) slices of
  the reduced gradients;
- :class:`FiniteFlags` (``trace.finite``): what ``check_nan_inf`` checks.

Settings are not kept here: they come from the objects passed to the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from fleet._errors import FleetError

_TWICE = (
    "the wrapped model is called inside a JAX transformation that closes over it (jax.grad "
    "of the inputs, jax.vmap over the rows: a gradient penalty), and the loss is "
    "differentiated through that call, so the parameter {key!r} is synced twice in the "
    "step; under no_sync, strategy.gradient_merge or sharding stage 3 fleet accumulates or "
    "slices each parameter's gradient once, and cannot here. Turn those off for this step, "
    "or compute the inputs' gradient outside the step")


@dataclasses.dataclass
class Accumulation:
    """``no_sync`` and gradient merge: the local gradients accumulated over calls."""

    no_sync: bool = False  # this call is inside no_sync: local gradients, accumulated
    given: dict = dataclasses.field(default_factory=dict)  # key -> accumulated local grad
    left: dict = dataclasses.field(default_factory=dict)  # key -> what the step leaves
    merge_counts: bool = False  # this call counts in gradient_merge's cycle (not explicit no_sync)
    merge_updates: int = 0  # updates of an optimizer that merges gradients (gradient_merge)

    def take(self, keys: Sequence, cts: Sequence) -> list:
        """``cts`` plus what ``no_sync`` accumulated for their keys, which is then
        consumed (the step leaves zeros)."""
        out = [ct + self.given[k] if k in self.given else ct for k, ct in zip(keys, cts)]
        for k in keys:
            if k in self.given:
                self.left[k] = None
        return out

    def add(self, key: str, grad: Any) -> None:
        """Under ``no_sync``: ``grad`` (local) added to ``key``'s accumulator."""
        self.left[key] = grad + self.given[key] if key in self.given else grad

    def count_merge(self) -> bool:
        """An update of an optimizer that merges gradients: counted if this call
        counts in gradient merge's cycle; returns whether it does."""
        if self.merge_counts:
            self.merge_updates += 1
        return self.merge_counts


@dataclasses.dataclass
class OptimizerCalls:
    """The distributed optimizer's updates in this trace, and how the synced
    gradients are scaled."""

    calls: int = 0  # distributed optimizer updates in this trace
    grads: set = dataclasses.field(default_factory=set)  # ids of the gradients they got
    auto_sum: bool = False  # gradients were summed by JAX: the optimizer divides by N
    #: the probe: the optimizer divides as if JAX summed the gradients typed the same
    #: on every replica (so its program is the real one if the checks find JAX did),
    #: and ``summed`` says whether it got any such gradient
    assume_sum: bool = False
    summed: bool = False
    divisor: Any = None  # synced gradients are divided by it (loss scale, merge avg)
    loss_scale: Any = None  # float16 amp: the distributed optimizer's scale, this step


@dataclasses.dataclass
class ShardGrads:
    """``strategy.sharding`` (ZeRO): each replica's slices of the reduced gradients."""

    config: Any = None  # strategy.sharding (fleet.sections._sharding.Config) when the step shards
    #: id(placeholder) -> (key, the local gradient or its reduced slice, stage 2)
    grads: dict = dataclasses.field(default_factory=dict)
    finite: Any = None  # float16 amp under sharding: all replicas' slices finite
    #: stage 3: ids of the parameters gathered in this trace (fleet.comm._param_gather)
    whole: set = dataclasses.field(default_factory=set)
    #: stage 3: id(placeholder) -> the layout of the parameter it stands for
    layouts: dict = dataclasses.field(default_factory=dict)
    #: the probe's (a list; None elsewhere): refusals its checks raise after the
    #: trace, once they looked for a more specific cause (fleet.step._probe_checks)
    refusals: list | None = None


@dataclasses.dataclass
class FiniteFlags:
    """``check_nan_inf``: what must be finite, and the distributed optimizers'
    updates to replay under the chain."""

    check: bool = False  # strategy.check_nan_inf: record what must be finite
    flags: list = dataclasses.field(default_factory=list)  # (name, all-finite flag)
    #: with check_nan_inf, the updates of this trace (fleet.sections._finite_replay.Recorder)
    recorder: Any = None

    def record(self, names: Sequence[str], leaves: Sequence) -> None:
        if self.check:
            self.flags.extend(
                (n, jnp.all(jnp.isfinite(x))) for n, x in zip(names, leaves)
                if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


@dataclasses.dataclass
class SyncTrace:
    """Bookkeeping of one trace of the step body (see the module docstring)."""

    num_replicas: int
    wrapped_syncs: int = 0  # buckets of wrapped-model parameters synced in this trace
    accum: Accumulation = dataclasses.field(default_factory=Accumulation)
    tx: OptimizerCalls = dataclasses.field(default_factory=OptimizerCalls)
    shard: ShardGrads = dataclasses.field(default_factory=ShardGrads)
    finite: FiniteFlags = dataclasses.field(default_factory=FiniteFlags)
    #: the metric updates of this trace (fleet.semantics._metrics.Updates), if any
    metrics: Any = None
    #: id(parameter value) -> its synced (stage 3: gathered) value, read once per trace
    #: (fleet.comm._sync.sync_leaves)
    synced: dict = dataclasses.field(default_factory=dict)
    #: depth of wrapped-model calls inside a JAX transformation that closes over the
    #: model (jax.grad of the inputs: fleet.comm._synced.bucketed_call)
    foreign: int = 0
    #: the values the step keeps as replica 0's (fleet_written): a parameter a wrapped
    #: model's call wrote (nnx.SpectralNorm's kernel: fleet.comm._synced), state set
    #: under no_sync from the parameters (an EMA: fleet.step._program); each one's
    #: refusal should it be computed from per-replica values, in call order
    written: list = dataclasses.field(default_factory=list)
    #: names of the wrapped parameters set in this trace (``variable[...] = x``, also
    #: into a transformation's copy): fleet.comm._synced.SyncedRead.set_value
    writes: set = dataclasses.field(default_factory=set)
    #: the values whose ids tx.grads and shard.grads hold, kept alive for the trace so
    #: that no later value (an output) gets one of their ids
    held: list = dataclasses.field(default_factory=list)

    def twice(self, keys: Sequence, sliced: bool = False) -> None:
        """A backward pass of a sync made inside :attr:`foreign` calls: refused
        where each parameter's gradient is accumulated (``no_sync``, gradient
        merge) or kept as one slice (stage 3, ``sliced``), which a second sync of
        the parameter would add twice or leave twice."""
        if self.accum.no_sync or self.accum.given or sliced:
            raise FleetError(_TWICE.format(key=keys[0]))

    def hold(self, leaves: Sequence) -> list[int]:
        """The ids of ``leaves``, unique for the whole trace: the leaves are kept alive."""
        self.held.extend(leaves)
        return [id(x) for x in leaves]
