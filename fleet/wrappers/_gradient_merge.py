"""Gradient merge (``strategy.gradient_merge``, ``k_steps``) and the ``no_sync``
accumulation it runs on: the wrappers layer's one home for them.

A distributed
optimizer that merges steps once every ``k_steps`` calls: the calls before the
``k_steps``-th run as under ``no_sync`` (each replica adds its local gradients to
the optimizer's ``grad_accum``), the ``k_steps``-th syncs the sum (divided by
``k_steps`` under ``gradient_merge_configs.avg``) and steps. The count of calls
lives on the device, as ``optax.MultiSteps`` keeps its ``mini_step``: the state
:class:`MergeState`, made and moved by :class:`MergeSteps` (``init``, ``update``),
held in the optimizer's ``fleet_state.merge`` (:mod:`fleet.wrappers._fleet_state`),
so a checkpoint carries the position in the cycle (``fleet_state.merge.mini_step``;
``merge_count`` before, read by :mod:`fleet.checkpoint._migrate`), beside the sums,
``grad_accum``.

Here: :class:`MergeCount`, :class:`MergeState`, :class:`MergeSteps`, the
:class:`GradientMerge` part of
:class:`~fleet.wrappers._distributed_optimizer.DistributedOptimizer` (its
accumulator and counting), and the step's side
(:func:`prepare_accumulators`, :class:`MergePosition`, :func:`leave_accumulators`,
:func:`check_one_sum_each`).

Where gradient merge still touches other files, and why (one line each):

* ``strategy/_configs.py``: ``GradientMergeConfigs`` (``k_steps``, ``avg``): configuration only.
* ``comm/_trace.py``: ``Accumulation``, the trace's no_sync flag, sums and merge count (below wrappers).
* ``comm/_sync.py``: ``GradAccumulator``, ``accumulate``: sync's custom VJP adds or takes the sums.
* ``wrappers/_distributed_optimizer.py``: ``enter_trace`` sets one divisor with amp's loss scale.
* ``wrappers/_distributed_optimizer.py``: ``distributed_optimizer`` refuses merge on an optax transformation.
* ``step/_decorator.py``: on the host, asks :class:`MergePosition`; runs a "local" call as ``no_sync``.
* ``step/_graph.py``: ``Plan.grad_merge`` ("local", "final") keys the program; ``accum_keys`` finds sums.
* ``step/_program.py``: refuses a merge step without the optimizer; calls :func:`leave_accumulators`.
* ``step/_record.py``: a program's count of merging updates (the host's count follows it).
* ``step/_recall.py``: merge calls skip the fast path (their program changes with the position).
* ``step/_verify.py``, ``step/_verify_sections.py``: verify's reference sums like ``optax.MultiSteps``.
* ``checkpoint/_restore.py``: a mid-accumulation checkpoint grows ``grad_accum`` (``ensure_accumulator``).
* ``checkpoint/_migrate.py``: reads an older checkpoint's ``merge_count`` as ``fleet_state.merge.mini_step``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fleet._errors import FleetError
from fleet.comm import _sync, _synced
from fleet.runtime._leaves import dotted, module_variables
from fleet.runtime._world import world


class MergeCount(nnx.Variable):
    """``strategy.gradient_merge``: calls since the last optimizer step (the leaf
    of :class:`MergeState` on the optimizer)."""


class MergeState(NamedTuple):
    """Gradient merge's state, as ``optax.MultiStepsState`` keeps it: ``mini_step``,
    the calls since the last optimizer step (0 .. ``k_steps - 1``). The sums
    themselves are the wrapped model's (``grad_accum``, per replica)."""

    mini_step: Any


@dataclasses.dataclass(frozen=True)
class MergeSteps:
    """``strategy.gradient_merge`` as an optax-style ``(init, update)`` pair, after
    ``optax.MultiSteps``: :meth:`init` makes the state, :meth:`update` gives the
    state after one call (counted when the call counts in the cycle)."""

    k_steps: int
    avg: bool

    @classmethod
    def of(cls, strategy: Any) -> MergeSteps | None:
        """The strategy's merge (``None`` unless it merges ``k_steps > 1`` calls)."""
        cfg = strategy.gradient_merge_configs
        return cls(cfg.k_steps, cfg.avg) if strategy.gradient_merge and cfg.k_steps > 1 else None

    def init(self) -> MergeState:
        return MergeState(jnp.zeros((), jnp.int32))

    def update(self, state: MergeState) -> MergeState:
        """``state`` after a call that counts in the cycle (not an explicit ``no_sync``)."""
        return MergeState((state.mini_step + 1) % self.k_steps)

    def divisor(self, divisor: Any, grad_merge: str | None) -> Any:
        """``gradient_merge_configs.avg``: on the final call, ``divisor`` (or 1)
        times ``k_steps``."""
        if grad_merge == "final" and self.avg:
            k = jnp.asarray(self.k_steps, jnp.float32)
            divisor = k if divisor is None else divisor * k
        return divisor


class GradientMerge:
    """The gradient merge and ``no_sync`` part of a distributed optimizer (an
    ``nnx.Optimizer``): ``merge`` (its :class:`MergeSteps`, or ``None``) and
    ``grad_accum``; the merge's state is ``fleet_state.merge``
    (:mod:`fleet.wrappers._fleet_state`)."""

    @property
    def merge_count(self) -> MergeCount:
        """The calls since the last step (``fleet_state.merge.mini_step``)."""
        return self.fleet_state.merge.mini_step

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

    def accumulated(self, trace: _sync.SyncTrace | None, model: Any, grads: Any) -> bool:
        """An update's start in ``trace``: counted in the merge cycle; under
        ``no_sync`` (or a merge call before the ``k_steps``-th) the gradients of
        ``model``'s parameters are added to the accumulator. Returns whether they
        were (nothing steps)."""
        if self.merge is not None and trace is not None and trace.accum.count_merge():
            state = self.pure_fleet_state()
            self.update_fleet_state(state._replace(merge=self.merge.update(state.merge)))
        if trace is not None and trace.accum.no_sync:  # add to the accumulator; nothing steps
            _sync.accumulate(_by_parameter(model, nnx.state(grads, self.wrt)))
            return True
        return False


def _by_parameter(model: Any, grads: Any) -> dict[str, Any]:
    """The gradients by their parameters' names in the wrapped model, the
    accumulator's keys: also where the optimizer holds a part of the model
    (``nnx.Optimizer(agent.online, ...)``), whose paths start below the model's.
    The names are read from ``model``'s own parameters (a gradient's copy of the
    metadata may come from a cached trace of a same-shaped part)."""
    params = module_variables(model)
    flat = jax.tree_util.tree_flatten_with_path(
        grads, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    out = {}
    for path, g in flat:
        key = dotted(path)
        spec = (params[key].get_metadata("fleet_sync", None)
                if isinstance(params.get(key), _synced.SyncedRead) else None)
        out[key if spec is None else spec.key] = (
            g.get_raw_value() if isinstance(g, nnx.Variable) else g)
    return out


# --------------------------------------------------------------------------- the step's side


def prepare_accumulators(objs: tuple) -> bool:
    """Before a no_sync step: gives each distributed optimizer its accumulator for
    the wrapped parameters among ``objs``. Returns whether a graph changed."""
    optimizers = [o for o in objs if isinstance(o, GradientMerge)
                  and getattr(o, "grad_accum", None) is None]
    if not optimizers:  # (the usual case: created at the first no_sync step)
        return False
    params = {}
    for obj in objs:
        if not isinstance(obj, GradientMerge):
            params.update({k: (v.get_raw_value().shape, v.get_raw_value().dtype)
                           for k, v in module_variables(obj).items()
                           if isinstance(v, _synced.SyncedRead)})
    return any([o.ensure_accumulator(params) for o in optimizers])


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
        merging = [o for o in objs if isinstance(o, GradientMerge) and o.merge is not None]
        if not merging or no_sync:  # explicit no_sync: accumulate, do not count
            return None, 0
        if len(merging) > 1:  # (one divisor in the trace: it would be k_steps ** 2)
            raise FleetError(
                f"strategy.gradient_merge with {len(merging)} distributed optimizers in one step "
                "is not supported: their merged gradients would be divided once per optimizer. "
                "Step each optimizer in its own fleet.distributed_step (one call each per batch).")
        opt = merging[0]
        value = opt.fleet_state.merge.mini_step.get_raw_value()
        seen = self._seen.get(id(opt))
        if seen is None or seen[0]() is not value:
            seen = (weakref.ref(value), int(np.asarray(value.addressable_shards[0].data)))
            self._seen[id(opt)] = seen
        return opt, seen[1]

    def advanced(self, objs: tuple) -> None:
        """After a call that updated a merging optimizer: its new count, known."""
        for opt in objs:
            seen = self._seen.get(id(opt))
            if isinstance(opt, GradientMerge) and seen is not None:
                self._seen[id(opt)] = (weakref.ref(opt.fleet_state.merge.mini_step.get_raw_value()),
                                       (seen[1] + 1) % opt.merge.k_steps)


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


def check_one_sum_each(accum_keys: list, objs: tuple) -> None:
    """Refuses a step whose accumulated sums would mix (the trace keeps one sum per
    parameter name): sums (``no_sync``, gradient merge) for two wrapped parameters
    of the same name, such as those of two wrapped models of one class. Models
    whose parameters' names differ accumulate as on one device. (Two optimizers
    that merge gradients are refused before, by :meth:`MergePosition.find`.)"""
    if not any(k is not None for k in accum_keys):
        return
    owner: dict[str, int] = {}  # a wrapped parameter's name -> its variable
    twice = set()
    for obj in objs:
        if not isinstance(obj, GradientMerge):
            for key, v in module_variables(obj).items():
                if isinstance(v, _synced.SyncedRead) and owner.setdefault(key, id(v)) != id(v):
                    twice.add(key)
    twice = sorted(twice)
    if twice:
        raise FleetError(
            f"this step accumulates gradients (no_sync or gradient_merge) for two wrapped "
            f"parameters of the same name ({', '.join(map(repr, twice[:3]))}"
            f"{', ...' if len(twice) > 3 else ''}): fleet keeps one sum per name, so the "
            "models' sums would mix. Step each model and its optimizer in its own "
            "fleet.distributed_step, or give the models' layers different names.")
