"""What a step knows about its arguments between calls: the plan and the graph.

:class:`Plan` is everything static about one call, the ``jit`` cache key.
:class:`GraphCache` is the NNX objects' graph, split once and reused while their
structure holds: the variables the step reads before a call and writes after
it, and what each one is (synced parameter, per-replica accumulator, sharded
optimizer state, buffer). :func:`tree_layout` and :func:`tree_rows` place the
sharded optimizer state of pytree arguments (``fleet.strategy._sharding.Shard``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.training.optimizer import OptState

from fleet import _compat, _sync
from fleet._tree import dotted
from fleet.strategy import _sharding


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Everything static about one call: the jit cache key.

    jit hashes it on every call, and an NNX graphdef is slow to hash, so the hash
    is computed once and a step reuses the plan while nothing static changes.
    """

    kinds: tuple[str, ...]
    kw_names: tuple[str, ...]
    statics: tuple[Any, ...]
    graphdef: Any
    state_treedef: Any
    no_sync: bool
    check_nan_inf: bool
    mesh: Any
    grad_merge: str | None = None  # strategy.gradient_merge: "local" calls, then "final"
    sharded: bool = False  # strategy.sharding: the step holds sharded optimizer state
    tree_shards: Any = None  # the trees' structure, with sharded leaves (fleet.strategy._sharding.Shard)

    def _key(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(tuple(_hash_of(v) for v in self._key())))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (
            isinstance(other, Plan) and self._hash == other._hash and self._key() == other._key()
        )


def _hash_of(value: Any) -> int:
    """``hash(value)``, or for a value Python cannot hash (an NNX graph holding a
    module's plain ``dict`` attribute) its type's: equal plans still hash alike,
    and ``__eq__`` tells such plans apart."""
    try:
        return hash(value)
    except TypeError:
        return hash(type(value).__qualname__)


class GraphCache:
    """The NNX objects' graph, split once and reused while their structure holds."""

    def __init__(self, objs: tuple, positions: list[int]):
        self.objs = objs
        self.tree_vars, self.treedef = self._tree_view(objs)
        self.graphdef, state = nnx.split(objs)
        with_path = jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
        self.variables = [v for _, v in with_path]
        index = [int(dotted(p[:1])) for p, _ in with_path]
        self.names = [
            f"argument {positions[i]} ({type(objs[i]).__name__}) variable {dotted(p[1:])!r}"
            for i, (p, _) in zip(index, with_path)
        ]
        self.state_treedef = jax.tree_util.tree_structure(state)
        self.synced = [isinstance(v, _sync.SyncedRead) for v in self.variables]
        # Per-replica state (no_sync accumulators): sharded over data, varying inside.
        self.per_replica = tuple(isinstance(v, _sync.PerReplica) for v in self.variables)
        self.accum_keys = [p[-1].key.replace(":", ".")
                           if isinstance(v, _sync.GradAccumulator) else None
                           for p, v in with_path]
        self.sharded = any(isinstance(v, _sharding.ShardedState) for v in self.variables)
        # Plain array variables: read and written through Flax's raw fields
        # (fleet/_compat.py), skipping Variable.__setattr__'s trace checks.
        self.fast = _compat.fast_variables(self.variables) and (
            self.state_treedef.num_leaves == len(self.variables)
        )

    @staticmethod
    def _tree_view(objs: tuple) -> tuple[list, Any]:
        return jax.tree_util.tree_flatten(objs, is_leaf=lambda v: isinstance(v, nnx.Variable))

    def holds(self, objs: tuple) -> bool:
        if len(objs) != len(self.objs) or any(a is not b for a, b in zip(objs, self.objs)):
            return False
        tree_vars, treedef = self._tree_view(objs)
        return treedef == self.treedef and all(a is b for a, b in zip(tree_vars, self.tree_vars))

    def read(self) -> list:
        if self.fast:
            return _compat.read_raw(self.variables)
        return [v.get_raw_value() for v in self.variables]

    def write(self, values: Sequence) -> None:
        if self.fast:  # outside any trace: skip Variable.__setattr__'s trace checks
            _compat.write_raw(self.variables, values)
        else:
            for v, x in zip(self.variables, values):
                v.set_raw_value(x)


def is_buffer(v: nnx.Variable) -> bool:
    """Model state that is neither a parameter nor optimizer state (batch-norm
    statistics): each replica updates it from its own rows."""
    return not isinstance(v, (nnx.Param, OptState)) and jnp.issubdtype(
        jnp.result_type(v.get_raw_value()), jnp.inexact)


def tree_layout(tree_shards: tuple, sharded: Any, other: Any) -> list:
    """The tree arguments' structure with ``sharded`` at their sharded optimizer
    state (fleet.strategy._sharding.Shard) and ``other`` elsewhere: their specs or shardings."""
    structure, flags = tree_shards
    return jax.tree.unflatten(structure, [sharded if f else other for f in flags])


def tree_rows(trees: list) -> list:
    """Sharded tree leaves entering the body: the replica's row."""
    return jax.tree.map(lambda x: _sharding.Shard(x.value[0], x.layout)
                        if _sharding.is_shard(x) else x, trees, is_leaf=_sharding.is_shard)
