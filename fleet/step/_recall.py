"""A repeated call's fast path: what a step decided at its last call, and the
checks that those decisions still hold.

A training loop calls its step with the same model and optimizer objects and a
new batch of the same kind, thousands of times. ``DistributedStep._prepare``
works out each argument's role, the NNX graph, the plan (the ``jit`` key); on a
small model on a GPU its Python time is a real part of the step. :class:`Recall`
keeps what the last call decided and, for the next call, checks only what can
differ between two calls of a loop:

* the same number of positional arguments and no keywords, each of the same
  type; the same NNX objects (by identity) with the same structure (their
  :class:`fleet.step._graph.Fingerprint`); the same static values;
* each array argument's role again (``fleet.step._roles.kind``: a batch is split,
  a replicated array is state), when it does not look as the last one did
  (its sharding and shape); each pytree argument's (a Linen ``TrainState``, a
  batch given as a dict or a tuple), from its leaves, and its structure, at
  every call;
* the same mesh and the same strategy switches read at each call
  (``check_nan_inf``, ``sharding``), and no ``no_sync`` block.

Anything else, and every call that cannot be recalled (gradient merge, ZeRO,
``no_sync``, keyword arguments), takes the full path, which decides the same
things from scratch. The batch is still checked and placed at every call
(``fleet.step._global_arrays.global_batch``), and a multi-process job still agrees on
each new program and on changed scalars (``DistributedStep._call_args``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from fleet.comm import _sync
from fleet.runtime._world import World, world
from fleet.step import _roles
from fleet.step._global_arrays import global_batch
from fleet.step._graph import GraphCache, Plan


class Recall:
    """The last call's decisions (see the module docstring)."""

    def __init__(self, args: tuple, kinds: tuple, batch_argnums: tuple | None, plan: Plan,
                 graph: GraphCache, run: Callable, batch: list):
        self.types = tuple(map(type, args))
        self.kinds = kinds
        self.plan, self.graph, self.run = plan, graph, run
        self.positions = _roles.Positions(kinds)
        self.obj_ids = tuple(map(id, self.positions.nnx(args)))
        self.batch_argnums = batch_argnums
        self.arrays = self._arrays(args, batch)
        # Pytree arguments (state such as a TrainState, a batch given as a dict or a
        # tuple): their role is decided again at each call, from their leaves.
        # Each one's structure is the plan's too (Plan.arg_structure).
        self.trees = [(i, self._argnum(i), kinds[i] == _roles.BATCH,
                       jax.tree_util.tree_structure(a))
                      for i, a in enumerate(args)
                      if kinds[i] in (_roles.TREE, _roles.BATCH) and not _roles.is_array(a)]
        # No pytree state nor pytree batch: the batch and the replicated values are
        # arrays and scalars (fleet.step._donate.split_flat).
        self.flat = not self.trees and _roles.TREE not in kinds

    def _argnum(self, i: int) -> bool | None:
        return None if self.batch_argnums is None else i in self.batch_argnums

    def _arrays(self, args: tuple, batch: list) -> list[tuple]:
        """Each array argument: its position, batch_argnums' word on it, whether it is
        a ``jax.Array``, its sharding (numpy: dtype) and shape (which decide its role
        and placement), whether it is batch, and whether
        ``fleet.step._global_arrays.global_batch`` passed it as it was."""
        given = {i for i, placed in zip(self.positions.batch, batch) if placed is args[i]}
        return [(i, self._argnum(i), isinstance(a, jax.Array), _looks(a),
                 self.kinds[i] == _roles.BATCH, i in given)
                for i, a in enumerate(args) if _roles.is_array(a)]

    @classmethod
    def of(cls, args: tuple, kwargs: dict, kinds: tuple, batch_argnums: tuple | None,
           plan: Plan, graph: GraphCache, w: World, run: Callable,
           batch: list) -> Recall | None:
        """The decisions of a call that took the full path (``batch``: its batch as
        placed), or ``None`` when a next call could not be checked cheaply."""
        if (kwargs or plan.grad_merge is not None or plan.no_sync or plan.sharded
                or plan.tree_shards is not None or w.strategy.sharding
                or graph.fingerprint is None):
            return None
        return cls(args, kinds, batch_argnums, plan, graph, run, batch)

    def match(self, args: tuple, kwargs: dict, graph: GraphCache | None) -> list | None:
        """The batch of a call with these arguments, placed, if the call decides
        what the last one did (``graph``: the step's graph now); else ``None``."""
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
