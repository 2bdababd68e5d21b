"""The decision path of ``fleet.distributed_step``: what a call is.

:func:`decide` is the one place that decides what a call is (its body was
``DistributedStep._decide`` in ``fleet.step._decorator``, which now calls it):
each argument's role (``fleet.step._roles``), the NNX graph it carries
(``fleet.step._graph.GraphCache``), ``no_sync`` and the gradient merge position,
the pytree arguments' sharded leaves, and the :class:`Plan` (the ``jit`` key).
It returns the :class:`fleet.step._recall.Decision` that the fast path reuses.
Beside it, the checks of the step's options against a call: ``batch_argnums``
when the step is made (:func:`batch_positions`) and at each decided call
(:func:`check_argnums`), and the static values' hashes when a plan is made
(:func:`plan_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.comm import _sync
from fleet.runtime._world import World, world
from fleet.sections import _sharding, _stage3
from fleet.step import _hints, _roles
from fleet.step._graph import GraphCache, Plan
from fleet.step._program import Program
from fleet.step._recall import Decision, decision
from fleet.wrappers._distributed_optimizer import prepare_sharding
from fleet.wrappers._gradient_merge import MergePosition, prepare_accumulators


def decide(program: Program, merge: MergePosition, batch_argnums: tuple | None,
           last_plan: Plan | None, args: tuple, kwargs: dict,
           statics: Statics | None = None) -> Decision:
    """What a call is, and what that depended on. ``program.graph`` is made
    again when the NNX objects changed (or their accumulators or shards were
    just made); ``last_plan`` is reused when nothing static changed. ``statics``:
    the arguments declared static (``static_argnums`` / ``static_argnames``)."""
    w = world()
    names = tuple(sorted(kwargs))
    values = list(args) + [kwargs[k] for k in names]
    check_argnums(batch_argnums, len(args))
    declared = () if statics is None else statics.at(len(args), names)
    kinds = tuple(
        _roles.STATIC if i in declared else
        _roles.kind(v, None if batch_argnums is None else i in batch_argnums, w.num_replicas)
        for i, v in enumerate(values)
    )
    for i in declared:
        _roles.check_declared_static(values, i, names)
    _roles.check_static_objects(values, kinds, names)
    positions = [i for i, k in enumerate(kinds) if k == _roles.NNX]
    objs = tuple(values[i] for i in positions)
    no_sync = _sync.no_sync_active()
    merging, position = merge.find(objs, no_sync)
    grad_merge = None
    if merging is not None:
        grad_merge = "final" if position == merging.merge.k_steps - 1 else "local"
        no_sync = grad_merge == "local"
    if no_sync and _stage3.active(w.strategy):
        raise _stage3.refuse("no_sync" if grad_merge is None else "gradient_merge")
    if no_sync and prepare_accumulators(objs):
        program.graph = None
    if w.strategy.sharding and prepare_sharding(objs):
        program.graph = None
    if program.graph is None or not program.graph.holds(objs):
        program.graph = GraphCache(objs, positions)
    tree_shards = _tree_shards([v for v, k in zip(values, kinds) if k == _roles.TREE], w)
    plan = plan_of(
        last_plan,
        sharded=program.graph.sharded or tree_shards is not None,
        tree_shards=tree_shards,
        kinds=kinds,
        kw_names=names,
        statics=tuple(v for v, k in zip(values, kinds) if k == _roles.STATIC),
        graphdef=program.graph.graphdef,
        state_treedef=program.graph.state_treedef,
        no_sync=no_sync,
        check_nan_inf=w.strategy.check_nan_inf,
        mesh=w.mesh,
        grad_merge=grad_merge,
        arg_structure=jax.tree.structure(
            [v for v, k in zip(values, kinds) if k in (_roles.TREE, _roles.BATCH)]),
    )
    return decision(args, kwargs, kinds, batch_argnums, plan, program.graph, w)


def _tree_shards(trees: list, w: World) -> tuple | None:
    """``strategy.sharding``: the pytree arguments' structure and which of their
    leaves are shards (``fleet.sections._sharding.Shard``); ``None`` when none is."""
    if w.strategy.sharding and trees:
        leaves, structure = jax.tree.flatten(trees, is_leaf=_sharding.is_shard)
        flags = tuple(map(_sharding.is_shard, leaves))
        if any(flags):
            return structure, flags
    return None


def plan_of(last: Plan | None, **fields: Any) -> Plan:
    """The call's :class:`Plan`: ``last`` when it has these fields, else a new one,
    its static values checked hashable (a plan is the ``jit`` key)."""
    if last is not None and last.same_as(fields):
        return last
    for value in fields["statics"]:
        try:
            hash(value)
        except TypeError:
            raise FleetTypeError(
                f"an argument of type {type(value).__name__} is passed to the step as a "
                "static value (it holds no arrays), but it is not hashable; pass arrays, "
                "NNX objects or scalars, or make it hashable (a tuple instead of a list)"
            ) from None
    return Plan(**fields)


def batch_positions(batch_argnums: Any) -> tuple | None:
    """``distributed_step``'s ``batch_argnums``: one position made a tuple; each
    checked a non-negative int."""
    if batch_argnums is not None:
        if isinstance(batch_argnums, int):
            batch_argnums = (batch_argnums,)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                   for i in batch_argnums):
            raise FleetConfigError(
                f"batch_argnums={batch_argnums!r} must be non-negative ints (positions of "
                "the batch arguments), e.g. batch_argnums=(2, 3)"
            )
    return batch_argnums


def check_argnums(batch_argnums: Sequence[int] | None, n_positional: int) -> None:
    """``batch_argnums`` names only positions the call has."""
    if batch_argnums is not None:
        bad = [i for i in batch_argnums if i >= n_positional]
        if bad:
            raise FleetConfigError(
                f"batch_argnums={batch_argnums} names position(s) {bad}, but the "
                f"step was called with {n_positional} positional arguments (0.."
                f"{n_positional - 1}); give the positions of the batch arguments"
            )


class Statics:
    """``distributed_step``'s ``static_argnums`` and ``static_argnames``, each
    completed from the other by the step function's signature, as ``jax.jit``
    does; checked when the step is made."""

    def __init__(self, fn: Any, argnums: Any, argnames: Any) -> None:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
        names = (argnames,) if isinstance(argnames, str) else tuple(argnames or ())
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
            raise FleetConfigError(
                f"static_argnums={argnums!r} must be non-negative ints (positions of the "
                "arguments the step takes as static values), e.g. static_argnums=(4,)")
        if not all(isinstance(n, str) for n in names):
            raise FleetConfigError(
                f"static_argnames={argnames!r} must be strings (names of the arguments "
                "the step takes as static values), e.g. static_argnames=('train',)")
        positional = _hints.parameter_names(fn)  # (none: the names and positions as given)
        self.nums = frozenset(nums) | {positional.index(n) for n in names if n in positional}
        self.names = frozenset(names) | {positional[i] for i in nums if i < len(positional)}

    def at(self, n_positional: int, kw_names: Sequence[str]) -> frozenset:
        """The indices of a call's values (positional, then keywords by name) declared static."""
        return frozenset(i for i in self.nums if i < n_positional) | {
            n_positional + j for j, name in enumerate(kw_names) if name in self.names}

    def overlap(self, batch_argnums: tuple | None) -> None:
        """A position cannot be both batch and static."""
        both = sorted(self.nums.intersection(batch_argnums or ()))
        if both:
            raise FleetConfigError(
                f"position(s) {both} are in both batch_argnums and static_argnums; an "
                "argument is either batch data (split over the replicas) or a static value")
