"""Roles: what each argument of a distributed step is, and how each output
comes back. The rules are stated in ``fleet.step._decorator``'s docstring; this module
applies them (one rule each for arguments and outputs, by vma type where JAX
knows it)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fleet._errors import FleetConfigError, FleetError, FleetTypeError, batch_rows, nth
from fleet.comm import _sync
from fleet.runtime._leaves import dotted
from fleet.runtime._world import DATA_AXIS
from fleet.sections._sharding import is_shard

NNX, TREE, BATCH, REPL, STATIC = "nnx", "state", "batch", "replicated", "static"
REDUCES = ("mean", "sum", "max", "min", "gather", None)
#: An undeclared scalar that differs across replicas: the probe's trace decides
#: its combination (fleet.semantics._outputs) before the real trace.
SCALAR = "scalar"


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _is_batch_like(x: Any) -> bool:
    if is_array(x):
        return np.ndim(x) > 0
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return len(x) > 0 and all(_is_batch_like(v) for v in x)
    if isinstance(x, dict):
        return len(x) > 0 and all(_is_batch_like(v) for v in x.values())
    return False


_ARRAY_LEAVES = (jax.Array, np.ndarray, int, float, np.generic)  # a pytree of arrays holds these


def _replicated_on(x: Any, n: int) -> bool:
    """Whether ``x`` is a jax.Array already replicated over the ``n`` mesh devices
    (a value a step returned: parameters, averaged gradients)."""
    if not (isinstance(x, jax.Array) and x.is_fully_replicated
            and len(x.sharding.device_set) == n):
        return False
    spec = getattr(x.sharding, "spec", None)  # a batch sharded over `data` (one device) is not
    return spec is None or DATA_AXIS not in jax.tree.leaves(tuple(spec))


def kind(x: Any, is_batch: bool | None, n: int, leaves: list | None = None) -> str:
    """The role of a step argument: one of NNX, TREE, BATCH, REPL, STATIC
    (``leaves``: the argument's pytree leaves, where the caller has them)."""
    if isinstance(x, (jax.Array, np.ndarray)):  # first: the common case, decided cheaply
        if x.ndim == 0:
            return REPL
        if is_batch is None:
            return TREE if _replicated_on(x, n) else BATCH
        return BATCH if is_batch else TREE
    if isinstance(x, nnx.Pytree):
        return NNX
    if isinstance(x, (bool, int, float, complex, np.generic)) or (
        is_array(x) and np.ndim(x) == 0
    ):
        return REPL
    if is_batch:
        return BATCH
    if leaves is None:
        leaves = jax.tree_util.tree_leaves(x)
    if is_batch is None and _is_batch_like(x) and not all(_replicated_on(v, n) for v in leaves):
        return BATCH
    # a pytree of arrays (and scalars) is state; anything else is a static value
    return TREE if leaves and all(map(isinstance, leaves, repeat(_ARRAY_LEAVES))) else STATIC


def tree_variables(values: Sequence, kinds: Sequence) -> list:
    """The NNX variables inside the pytree arguments (a bare ``nnx.Variable``, a
    tuple of optimizers, an ``nnx.State``) as the body enters them: ``(position,
    path, variable, its value)``, for :func:`check_tree_writes`."""
    return [(i, p, x, x.get_raw_value()) for i, (v, k) in enumerate(zip(values, kinds))
            if k == TREE and not is_array(v) for p, x in _held(v, nnx.Variable)]


def _held(tree: Any, types: Any) -> list:
    """``(path, node)`` of the nodes of ``tree`` of ``types``, not looked into."""
    return [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, types))[0] if isinstance(x, types)]


def _argument(i: int, values: Sequence, kw_names: Sequence) -> str:
    """A step argument by position, or by keyword after the positional ones."""
    n_pos = len(values) - len(kw_names)
    return nth(i) if i < n_pos else f"argument {kw_names[i - n_pos]!r}"


def check_tree_writes(entered: list, values: Sequence, kw_names: Sequence) -> None:
    """Refuses a step that wrote into a variable of a pytree argument
    (:func:`tree_variables`): fleet updates the NNX objects passed as arguments
    themselves, and takes a pytree argument's arrays as values, so the write (an
    optimizer's moments, a counter) would be lost, where ``nnx.jit`` keeps it. A
    read (a teacher's ``nnx.state``) is fine."""
    for i, path, variable, raw in entered:
        if variable.get_raw_value() is raw:
            continue
        where = _argument(i, values, kw_names)
        what = (f"{where}, an nnx.{type(variable).__name__}" if not path else
                f"the nnx.{type(variable).__name__} at [{dotted(path)}] of {where}, a "
                f"{type(values[i]).__name__}")
        raise FleetTypeError(
            f"the step writes into {what}: fleet updates the NNX objects passed to the step "
            "as arguments (a model, an optimizer), and takes other arguments' arrays as "
            f"values, so the write would be lost. {_OBJECTS_FIX}")


def check_static_objects(values: Sequence, kinds: Sequence, kw_names: Sequence) -> None:
    """Refuses a static argument (one that holds values other than arrays) that
    holds NNX objects or variables: the step would read them as constants of
    its compiled program, stale once they change, and could not write them."""
    for i, (v, k) in enumerate(zip(values, kinds)):
        found = _held(v, (nnx.Pytree, nnx.Variable)) if k == STATIC else []
        if found:
            path, obj = found[0]
            raise FleetTypeError(
                f"{_argument(i, values, kw_names)}, a {type(v).__name__}, holds an NNX object "
                f"({type(obj).__name__} at [{dotted(path)}]) beside values that are not "
                "arrays, so it would be a static value of the step: its arrays constants of "
                "the compiled program, stale once they change, and the step's writes into it "
                f"lost. {_OBJECTS_FIX}")


def check_declared_static(values: Sequence, i: int, kw_names: Sequence) -> None:
    """An argument declared static (``static_argnums`` / ``static_argnames``) is a
    key of the compiled program, as under ``jax.jit``: hashable, and no array or
    NNX object, whose values would be constants of the program."""
    value, where = values[i], _argument(i, values, kw_names)
    if is_array(value) or isinstance(value, (nnx.Pytree, nnx.Variable)):
        what = "an array" if is_array(value) else f"an NNX object ({type(value).__name__})"
        raise FleetTypeError(
            f"{where} is declared static (static_argnums / static_argnames), but it is {what}: "
            "a static value is a key of the compiled program, and its arrays would be "
            "constants of it. Declare static only Python values the step branches on "
            "(a flag, a mode string), and pass arrays and NNX objects as they are")
    try:
        hash(value)
    except TypeError:
        raise FleetTypeError(
            f"{where} is declared static (static_argnums / static_argnames), but a "
            f"{type(value).__name__} is not hashable: a static value is a key of the "
            "compiled program. Pass a hashable value (a tuple instead of a list)") from None


_OBJECTS_FIX = (
    "Pass each object as its own argument (step(model, actor_optimizer, critic_optimizer, "
    "batch)), and hold variables and groups of objects in an nnx.Module (an attribute of "
    "the model), nnx.List or nnx.Dict")


class Positions:
    """Where each role's arguments are, from the roles of a call's arguments: each
    picker takes the arguments (positional, then keywords by name) and returns a
    tuple of those of its role, in order."""

    def __init__(self, kinds: tuple):
        def at(role: str) -> list[int]:
            return [i for i, k in enumerate(kinds) if k == role]

        self.nnx, self.trees, self.repl, self.statics = (
            _picker(at(role)) for role in (NNX, TREE, REPL, STATIC))
        self.batch = at(BATCH)  # (indices: the batch is placed with its position)


def _picker(indices: list[int]) -> Callable[[Sequence], tuple]:
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda values: (values[i],)
    return operator.itemgetter(*indices)


def rows_of(batch: Sequence) -> frozenset:
    """The row counts of the batch arguments' leaves (as the body sees them: the
    replica's rows inside a step)."""
    return frozenset(np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x))


def combine_outputs(out: Any, batch: list, out_reduce: Any) -> tuple[list, list[str], Any]:
    """Each output leaf and how it comes back (see fleet.step._decorator): ``replicated``,
    ``mean``, ``sum``, ``max``, ``min``, ``gather``, or :data:`SCALAR` (an
    undeclared scalar that differs across replicas: fleet.semantics._outputs decides);
    raises for what fleet cannot combine."""
    rows = rows_of(batch)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: isinstance(x, nnx.Pytree) or is_shard(x))
    declared = _declared_reduces(out, [p for p, _ in with_path], out_reduce)
    leaves, reduces = [], []
    for (path, x), reduce in zip(with_path, declared):
        name = dotted(path) or "the output"
        if is_shard(x):  # sharded optimizer state (a new TrainState's): stays per replica
            leaves.append(x.value)
            reduces.append(("shard", x.layout))
            continue
        if isinstance(x, nnx.Pytree):
            raise FleetTypeError(
                f"the step returned an NNX object at {name}; NNX objects passed to the "
                "step are updated in place, so return only arrays (loss, metrics)"
            )
        x = jnp.asarray(x)
        if not _sync.is_varying(x):
            reduce = "replicated"
        elif reduce is None:
            if x.ndim == 0 or not rows.intersection(x.shape):  # (no axis is the rows:
                reduce = SCALAR  # each element decided as a scalar, an ensemble's (members,))
            elif x.shape[0] in rows:
                reduce = "gather"
            else:
                raise FleetError(_not_per_example(name, x.shape, rows))
        elif reduce == "gather" and (x.ndim == 0 or x.shape[0] not in rows):
            raise FleetConfigError(
                f"out_reduce asks to gather output {name}, of shape {x.shape} for "
                f"{batch_rows(rows)}: 'gather' concatenates the replicas' leading axes, in "
                "batch order, so that axis must be the batch rows. " + (
                    "Use 'mean', 'sum', 'max' or 'min' for a scalar" if x.ndim == 0
                    else _rows_first(x.shape, rows) + "Or use 'mean', 'sum', 'max' or "
                    "'min', each element combined over the replicas"))
        leaves.append(x)
        reduces.append(reduce)
    return leaves, reduces, treedef


def _rows_first(shape: tuple, rows: frozenset) -> str:
    """What to write for an output whose batch rows are an axis other than its
    leading one (an empty string where none is)."""
    axis = next((d for d, n in enumerate(shape) if n in rows), None)
    if axis is None:
        return ""
    return (f"Its batch rows are its axis {axis} (an ensemble's (members, rows, ...) "
            f"outputs?): return jnp.moveaxis(out, {axis}, 0), which fleet gathers in "
            "batch order as on one device, and move the axis back after the step. ")


def _not_per_example(name: str, shape: tuple, rows: frozenset) -> str:
    hint = _rows_first(shape, rows)
    return (f"output {name} (shape {shape} for {batch_rows(rows)}) differs across replicas "
            "and is neither a scalar nor per example (its leading axis is not the batch "
            "rows), so fleet cannot combine it on its own. " + hint + ("Or d" if hint else "D")
            + "eclare how each of its elements combines over the replicas: "
            "fleet.distributed_step(fn, out_reduce=...) with 'mean', 'sum', 'max' or "
            "'min' at its position")


def _declared_reduces(out: Any, paths: list, out_reduce: Any) -> list:
    """The declared reduce of each output leaf (``paths``: their key paths): the
    entry of ``out_reduce`` at a prefix of its path (None: fleet decides)."""
    if out_reduce is None or isinstance(out_reduce, str):
        entries = [((), out_reduce)]
    else:
        entries = jax.tree_util.tree_flatten_with_path(
            out_reduce, is_leaf=lambda s: s is None or isinstance(s, str))[0]
    for _, s in entries:
        if s not in REDUCES:
            raise FleetConfigError(f"out_reduce value {s!r} is not one of {REDUCES}")

    def mismatch(what: str) -> FleetConfigError:
        return FleetConfigError(
            f"out_reduce={out_reduce!r} does not match the structure of the step's output "
            f"({jax.tree_util.tree_structure(out)}): {what}; give a prefix of it, with one "
            f"of {REDUCES} at each position (None: fleet decides)")

    def under(prefix: tuple, path: tuple) -> bool:
        return tuple(path[:len(prefix)]) == tuple(prefix)

    declared = []
    for path in paths:
        found = [s for prefix, s in entries if under(prefix, path)]
        if not found:
            raise mismatch(f"it has no entry for output {dotted(path) or 'the output'}")
        declared.append(found[0])
    for prefix, s in entries:
        if s is not None and not any(under(prefix, path) for path in paths):
            raise mismatch(f"it names output {dotted(prefix)}, which the step does not return")
    return declared
