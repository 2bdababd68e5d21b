"""A call's decisions, made on one path, and the fast path that reuses them.

``DistributedStep._decide`` is the one place that decides what a call is: each
argument's role, the NNX graph, the plan (the ``jit`` key), ``no_sync`` and the
gradient merge position. It returns a :class:`Decision`: those decisions and
what they depended on. A training loop calls its step with the same model and
optimizer objects and a new batch of the same kind, thousands of times; on a
small model on a GPU the decision path's Python time is a real part of the
step. :class:`Recall` caches the last decision and, for the next call, checks
only the inputs it depended on (microseconds):

* the same number of positional arguments and no keywords, each of the same
  type; the same NNX objects (by identity) with the same structure (their
  :class:`fleet.step._graph.Fingerprint`); the same static values;
* each array argument's role (``fleet.step._roles.kind``: a batch is split, a
  replicated array is state), decided again when the array does not look as
  the last one did (its sharding and shape); each pytree argument's (a Linen
  ``TrainState``, a batch given as a dict or a tuple), from its leaves, and its
  structure, at every call;
* the same mesh and the same strategy switches read at each call
  (``check_nan_inf``, ``sharding``), and no ``no_sync`` block.

A decision that depended on something else (gradient merge: the call's
position in the merge; ZeRO; ``no_sync``; keyword arguments) is not recalled
(:attr:`Decision.recallable`): every such call, and every call whose inputs do
not pass the checks, takes the decision path. The batch is still checked and
placed at every call (``fleet.step._global_arrays.global_batch``), and a
multi-process job still agrees on each new program and on changed scalars
(``DistributedStep._call_args``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from fleet.comm import _sync
from fleet.runtime._world import World, world
from fleet.step import _roles
from fleet.step._global_arrays import global_batch
from fleet.step._graph import GraphCache, Plan


@dataclasses.dataclass(frozen=True, eq=False)
class Decision:
    """What a call is (``DistributedStep._decide``), and what that depended on."""

    plan: Plan  # the jit key: roles, statics, graphdef, no_sync, merge position, mesh, ...
    kinds: tuple  # each argument's role (fleet.step._roles)
    positions: _roles.Positions  # where each role's arguments are
    graph: GraphCache  # the NNX objects' graph
    # What the decisions depended on, beyond the plan's fields: each positional
    # argument's type, batch_argnums' word on it (None: inferred), the NNX objects'
    # identities (their structure: graph.fingerprint) and each pytree argument's
    # structure. recallable: False when a decision depended on something that
    # changes between calls (a merge position, no_sync, ZeRO, keyword arguments).
    types: tuple
    words: tuple
    obj_ids: tuple
    trees: tuple  # (position, word, is batch, structure) of each pytree argument
    recallable: bool

    def values(self, args: tuple, kwargs: dict) -> list:
        """The call's arguments in order: the positional ones, then the keywords by name."""
        return list(args) + [kwargs[k] for k in self.plan.kw_names] if kwargs else list(args)


def decision(args: tuple, kwargs: dict, kinds: tuple, batch_argnums: tuple | None,
             plan: Plan, graph: GraphCache, w: World) -> Decision:
    """The :class:`Decision` of a call whose roles, plan and graph were just decided."""
    positions = _roles.Positions(kinds)
    words = tuple(None if batch_argnums is None else i in batch_argnums
                  for i in range(len(args)))
    return Decision(
        plan=plan, kinds=kinds, positions=positions, graph=graph,
        types=tuple(map(type, args)), words=words,
        obj_ids=tuple(map(id, positions.nnx(args))),
        trees=tuple((i, words[i], kinds[i] == _roles.BATCH, jax.tree_util.tree_structure(a))
                    for i, a in enumerate(args)
                    if kinds[i] in (_roles.TREE, _roles.BATCH) and not _roles.is_array(a)),
        recallable=not (kwargs or plan.grad_merge is not None or plan.no_sync or plan.sharded
                        or plan.tree_shards is not None or w.strategy.sharding
                        or graph.fingerprint is None))


class Recall:
    """The fast path: the last call's :class:`Decision` (its fields the checks
    read, copied here), the compiled program it runs, and how the last call's
    arrays looked (see the module docstring)."""

    def __init__(self, decided: Decision, run: Callable, args: tuple, batch: list):
        self.decision, self.run = decided, run
        self.plan, self.graph, self.kinds = decided.plan, decided.graph, decided.kinds
        self.positions, self.types, self.obj_ids = (decided.positions, decided.types,
                                                    decided.obj_ids)
        self.trees = decided.trees
        self.arrays = self._arrays(args, batch)
        # No pytree state nor pytree batch: the batch and the replicated values are
        # arrays and scalars (fleet.step._donate.split_flat).
        self.flat = not self.trees and _roles.TREE not in self.kinds

    def _arrays(self, args: tuple, batch: list) -> list[tuple]:
        """Each array argument: its position, batch_argnums' word on it, whether it is
        a ``jax.Array``, its sharding (numpy: dtype) and shape (which decide its role
        and placement), whether it is batch, and whether
        ``fleet.step._global_arrays.global_batch`` passed it as it was."""
        given = {i for i, placed in zip(self.positions.batch, batch) if placed is args[i]}
        words = self.decision.words
        return [(i, words[i], isinstance(a, jax.Array), _looks(a),
                 self.kinds[i] == _roles.BATCH, i in given)
                for i, a in enumerate(args) if _roles.is_array(a)]

    @classmethod
    def of(cls, decided: Decision, run: Callable, args: tuple, batch: list) -> Recall | None:
        """The fast path for the calls after one that took the decision path
        (``batch``: its batch as placed), or ``None`` when its decisions cannot be
        recalled."""
        return cls(decided, run, args, batch) if decided.recallable else None

    def match(self, args: tuple, kwargs: dict, graph: GraphCache | None) -> list | None:
        """The batch of a call with these arguments, placed, if every input the last
        decision depended on is as it was (``graph``: the step's graph now); else ``None``."""
        if kwargs or graph is not self.graph or tuple(map(type, args)) != self.types:
            return None
        w = world()
        strategy = w.strategy
        if (w.mesh is not self.plan.mesh or strategy.sharding or _sync.no_sync_active()
                or strategy.check_nan_inf != self.plan.check_nan_inf
                or tuple(map(id, self.positions.nnx(args))) != self.obj_ids):
            return None
        if self.plan.statics:
            try:
                if self.positions.statics(args) != self.plan.statics:
                    return None
            except Exception:  # noqa: BLE001 (a value whose == is not a bool: decide afresh)
                return None
        if not self.graph.fingerprint.same():
            return None
        placed, looks_same = {}, True
        for i, is_batch, is_jax, looks, in_batch, given in self.arrays:
            x = args[i]  # (of the type it had: checked above)
            # the same role and placement as the last call's:
            same = (x.sharding if is_jax else x.dtype, x.shape) == looks
            if not same:
                if _roles.kind(x, is_batch, w.num_replicas) != self.kinds[i]:
                    return None
                looks_same = False
            if in_batch:
                placed[i] = x if same and given else global_batch(i, x, w)
        for i, is_batch, in_batch, structure in self.trees:
            leaves, now = jax.tree_util.tree_flatten(args[i])
            if now != structure or _roles.kind(args[i], is_batch, w.num_replicas,
                                               leaves) != self.kinds[i]:
                return None
            if in_batch:
                placed[i] = global_batch(i, args[i], w)
        batch = [placed[i] for i in self.positions.batch]
        if not looks_same:  # (a numpy batch after a placed one): compare with this call's
            self.arrays = self._arrays(args, batch)
        return batch


def _looks(x: jax.Array | np.ndarray) -> tuple:
    return (x.sharding if isinstance(x, jax.Array) else x.dtype), x.shape
