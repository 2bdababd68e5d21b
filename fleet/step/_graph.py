"""What a step knows about its arguments between calls: the plan and the graph.

:class:`Plan` is everything static about one call, the ``jit`` cache key.
:class:`GraphCache` is the NNX objects' graph, split once and reused while their
structure holds: the variables the step reads before a call and writes after
it, and what each one is (synced parameter, per-replica accumulator, sharded
optimizer state, buffer). :func:`tree_layout` and :func:`tree_rows` place the
sharded optimizer state of pytree arguments (``fleet.sections._sharding.Shard``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping, MutableSequence, Sequence
from operator import is_
from typing import Any

import jax
from flax import nnx

from fleet import _compat
from fleet._errors import nth
from fleet.comm import _sync, _synced
from fleet.runtime._leaves import dotted, variables_of
from fleet.runtime._replicate import refuse_pytree_values, refuse_raw_arrays
from fleet.sections import _sharding


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
    tree_shards: Any = None  # the trees' structure, with sharded leaves (fleet.sections._sharding.Shard)
    # The pytree arguments' structure (state and batch): the program's record of
    # its outputs (fleet.step._program) is made for one structure.
    arg_structure: Any = None

    def _key(self) -> tuple:
        return self._fields

    def __post_init__(self):
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_hash", hash(tuple(_hash_of(v) for v in fields)))

    def same_as(self, fields: dict) -> bool:
        """Whether a plan of these fields would equal this one (each field the same
        object or equal), without making it."""
        return tuple(fields.get(name, default) for name, default in _FIELDS) == self._fields

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (
            isinstance(other, Plan) and self._hash == other._hash and self._key() == other._key()
        )


_FIELDS = tuple((f.name, f.default) for f in dataclasses.fields(Plan))


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
        self.objs, self.positions = objs, positions
        self.tree_vars, self.treedef = self._tree_view(objs)
        self.fingerprint = Fingerprint.of(objs)
        self.graphdef, state = nnx.split(objs)
        for i, obj in enumerate(objs):  # (the split state, by the objects' positions)
            refuse_raw_arrays(state[i], f"{nth(positions[i])} ({type(obj).__name__})")
            refuse_pytree_values(state[i], f"{nth(positions[i])} ({type(obj).__name__})")
        with_path = variables_of(state)
        self.variables = [v for _, v in with_path]
        index = [int(dotted(p[:1])) for p, _ in with_path]
        self.names = [
            f"{nth(positions[i])} ({type(objs[i]).__name__}) variable {dotted(p[1:])!r}"
            for i, (p, _) in zip(index, with_path)
        ]
        self.state_treedef = jax.tree_util.tree_structure(state)
        self.synced = [isinstance(v, _synced.SyncedRead) for v in self.variables]
        # Per-replica state (no_sync accumulators): sharded over data, varying inside.
        self.per_replica = tuple(isinstance(v, _sync.PerReplica) for v in self.variables)
        # An optimizer's state: its keys draw the single-device bits (fleet.semantics._random)
        self.optimizer_held = tuple(isinstance(v, nnx.OptState) for v in self.variables)
        nodes = [node for _, node in nnx.iter_graph(objs)]
        running = running_statistics(nodes)
        # Whether a trace looks for metrics among its merged objects
        # (fleet.semantics._metrics.global_updates, a walk of the graph).
        self.metrics = any(isinstance(node, nnx.metrics.Metric) for node in nodes)
        self.running_stats = tuple(id(v) in running for v in self.variables)
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
        """Whether ``objs`` are the objects this graph was split from, with the same
        structure: the same variables, sub-modules and static values. Checked on
        every call: by the fingerprint when nothing changed, else by flattening."""
        if len(objs) != len(self.objs) or any(a is not b for a, b in zip(objs, self.objs)):
            return False
        if self.fingerprint is not None and self.fingerprint.same():
            return True
        tree_vars, treedef = self._tree_view(objs)
        if treedef == self.treedef and all(a is b for a, b in zip(tree_vars, self.tree_vars)):
            self.fingerprint = Fingerprint.of(objs)  # a new but equal value (model.rate = 0.1)
            return True
        return False

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


_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None)})
_PARTS = (nnx.Variable, nnx.Pytree)


def _is_part(x: Any) -> bool:
    return issubclass(type(x), _PARTS)


class Fingerprint:
    """The structure of NNX objects, checked without flattening them (NNX flattens
    node by node in Python, 20-50 µs a node; this takes about 1 µs a node): each
    graph node's attribute names and the identity of each attribute's value, and
    for an attribute that can change in place (a list of modules, an optimizer's
    states of variables) its pytree structure and the identity of its leaves.

    The same fingerprint means the same graph as a flatten would give: the same
    sub-modules and variables, the same static values (a new value is a new
    object; the old ones are kept alive here, so an identity is never reused).
    Like the flatten's own structure, it does not see an object jax does not
    flatten (a module's static setting) changed in place; nor a pytree
    registered with jax that had no children and gained some in place; nor a
    variable's class changed in place (fleet does that only where it splits
    the graph again: ``prepare_accumulators``, ``prepare_sharding``). A node
    without ``__dict__`` has no fingerprint: :meth:`of` returns ``None``, and
    ``GraphCache.holds`` flattens on every call.
    """

    def __init__(self, nodes: list, parts: list, keep: list):
        self.nodes, self.parts, self._keep = nodes, parts, keep

    @classmethod
    def of(cls, objs: tuple) -> Fingerprint | None:
        nodes, parts, keep, seen, stack = [], [], [], set(), list(objs)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            fields = getattr(node, "__dict__", None)
            if not isinstance(fields, dict) or getattr(type(node), "__slots__", ()):
                return None
            nodes.append((node, len(fields), tuple(fields), tuple(fields.values())))
            for name, value in fields.items():
                if isinstance(value, nnx.Pytree):
                    stack.append(value)
                elif type(value) not in _ATOMS and not _is_part(value):
                    leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=_is_part)
                    stack.extend(x for x in leaves if isinstance(x, nnx.Pytree))
                    if _changes_in_place(value, leaves):
                        parts.append((node, name, treedef, _ids(leaves)))
                        keep.append(leaves)
        return cls(nodes, parts, keep)

    def same(self) -> bool:
        """Whether the objects still have this fingerprint (a name that is an equal
        but other string object reads as a change: the caller flattens then)."""
        for node, size, names, values in self.nodes:
            fields = vars(node)
            if not (len(fields) == size and all(map(is_, fields.values(), values))
                    and all(map(is_, fields, names))):
                return False
        for node, name, treedef, ids in self.parts:
            leaves, now = jax.tree_util.tree_flatten(vars(node)[name], is_leaf=_is_part)
            if now != treedef or _ids(leaves) != ids:
                return False
        return True


def _changes_in_place(value: Any, leaves: list) -> bool:
    """Whether a value's pytree structure or leaves can change while it stays the
    same object: a list, a dict, any container jax flattens into children, a
    tuple holding one; not a tuple of atoms, variables and opaque objects (an
    optax transformation), nor an object jax does not flatten."""
    if isinstance(value, tuple):
        return any(_changes_in_place(v, None) for v in value)
    if isinstance(value, (list, dict, MutableMapping, MutableSequence)):
        return True
    if type(value) in _ATOMS or _is_part(value):
        return False
    if leaves is None:
        leaves = jax.tree_util.tree_leaves(value, is_leaf=_is_part)
    return bool(leaves) and not (len(leaves) == 1 and leaves[0] is value)


def _ids(values: Any) -> tuple:
    return tuple(map(id, values))


def running_statistics(nodes: list) -> set[int]:
    """The ids of the running statistics (``mean``, ``var``) of each ``nnx.BatchNorm``
    among ``nodes`` (a graph's, ``nnx.iter_graph``): under ``sync_batch_norm=False``
    each replica updates them from its own rows, and the step averages them over
    the replicas, the one state fleet averages (the documented reference:
    ``fleet.sections._batch_norm``). Any other variable set from per-replica values
    (a count, a maximum, a sum, kept in an ``nnx.BatchStat`` or not) the step
    refuses (``fleet.step._tail``)."""
    return {id(getattr(node, name)) for node in nodes
            if isinstance(node, nnx.BatchNorm) for name in ("mean", "var")
            if isinstance(getattr(node, name, None), nnx.Variable)}


def tree_layout(tree_shards: tuple, sharded: Any, other: Any) -> list:
    """The tree arguments' structure with ``sharded`` at their sharded optimizer
    state (fleet.sections._sharding.Shard) and ``other`` elsewhere: their specs or shardings."""
    structure, flags = tree_shards
    return jax.tree.unflatten(structure, [sharded if f else other for f in flags])


def tree_rows(trees: list) -> list:
    """Sharded tree leaves entering the body: the replica's row."""
    return jax.tree.map(lambda x: _sharding.Shard(x.value[0], x.layout)
                        if _sharding.is_shard(x) else x, trees, is_leaf=_sharding.is_shard)


def restructured(objs: Any) -> str:
    """Why a step that changed its NNX objects' structure is refused, naming what
    ``Module.sow`` stored (``nnx.Intermediate``), the usual cause."""
    sown = [dotted(p[1:]) for p, _ in variables_of(nnx.state(objs, nnx.Intermediate))]
    if sown:
        return (f"the step stored intermediates in the model (Module.sow: {', '.join(sown[:3])}) "
                "and left them there: a fleet step keeps its NNX objects' structure. Take "
                "them out inside the step, as the loss reads them: nnx.pop(model, "
                "nnx.Intermediate) (or collect them with nnx.capture)")
    return ("the step changed the structure of an NNX object (added or removed a variable "
            "or sub-module); build the whole model before training")
