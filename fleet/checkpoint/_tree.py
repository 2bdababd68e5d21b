"""Training state as flat ``{dotted path: leaf}`` dicts, and how two of them differ.

A checkpoint stores each part of the training state (the model's variables, the
optimizer's, a functional ``state`` pytree, RNG keys) as one flat dict keyed by
dotted path, ``"linear1.kernel"``: the keys of ``DataParallel.state_dict()``.
PRNG keys are stored as their key data (``uint32``); the name of their
implementation goes into the checkpoint's JSON metadata and comes back as the
implementation of the key they are restored into.

Pure functions only: what is stored (:func:`stored`), what a restore reads
(:func:`target`), what it gives back (:func:`restored`), what differs
(:func:`differences`, :func:`fits`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fleet.runtime._leaves import dotted as _dotted
from fleet.runtime._leaves import first_replica, is_key
from fleet.sections._sharding import is_shard


def key_impls(leaves: dict[str, Any]) -> dict[str, str]:
    """``{path: implementation name}`` of the PRNG key leaves (``"threefry2x32"``)."""
    return {k: str(jax.random.key_impl(v)) for k, v in leaves.items() if is_key(v)}


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """``({dotted path: leaf}, treedef)`` of a pytree; a lone leaf is ``"value"``.
    Sharded optimizer state (``fleet.sections._sharding.Shard``) is one leaf, at the path
    the unsharded array has."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_shard)
    leaves = {(_dotted(path) or "value"): leaf for path, leaf in flat}
    if len(leaves) != len(flat):
        raise ValueError("two leaves of the tree have the same dotted path")
    return leaves, treedef


# A Python number in a template (``TrainState.create(...).step`` is ``0``) takes
# any stored scalar of its kind.
_PY_KINDS = {bool: ("bool", "b"), int: ("int", "iu"), float: ("float", "f"),
             complex: ("complex", "c")}


def signature(x: Any) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` of ``x`` as stored (PRNG keys as their key data); a
    Python number gives ``((), "int")`` (or ``"float"``, ...)."""
    if type(x) in _PY_KINDS:
        return (), _PY_KINDS[type(x)][0]
    if is_key(x):
        x = jax.random.key_data(x)
    return tuple(np.shape(x)), np.dtype(x.dtype).name


def fits(saved: tuple[tuple[int, ...], str], current: tuple[tuple[int, ...], str]) -> bool:
    """Whether a stored ``saved`` signature can be read into ``current``'s place."""
    if saved == current:
        return True
    kinds = {name: kind for name, kind in _PY_KINDS.values()}
    return (current[1] in kinds and saved[0] == current[0] == ()
            and np.dtype(saved[1]).kind in kinds[current[1]])


def describe(sig: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = sig
    return f"{dtype}[{', '.join(map(str, shape))}]"


def differences(
    saved: dict[str, tuple[tuple[int, ...], str]],
    current: dict[str, tuple[tuple[int, ...], str]],
    saved_impls: dict[str, str],
    current_impls: dict[str, str],
) -> list[str]:
    """Every way ``saved`` (the checkpoint) does not fit ``current`` (the live object).

    Example:
        >>> differences({"w": ((2,), "float32")}, {"w": ((3,), "float32"), "b": ((), "int32")},
        ...             {}, {})
        ["missing 'b' (int32[] here, not in the checkpoint)", "'w': checkpoint float32[2], here float32[3]"]
    """
    problems = [
        f"missing {k!r} ({describe(current[k])} here, not in the checkpoint)"
        for k in current if k not in saved
    ]
    problems += [
        f"unexpected {k!r} ({describe(saved[k])} in the checkpoint, not here)"
        for k in saved if k not in current
    ]
    for key in current:
        if key in saved and not fits(saved[key], current[key]):
            problems.append(
                f"{key!r}: checkpoint {describe(saved[key])}, here {describe(current[key])}"
            )
        elif key in saved and saved_impls.get(key) != current_impls.get(key):
            problems.append(
                f"{key!r}: checkpoint holds {_impl_text(saved_impls.get(key))}, "
                f"here {_impl_text(current_impls.get(key))}"
            )
    return problems


def _impl_text(impl: str | None) -> str:
    return f"a {impl!r} PRNG key" if impl else "plain data, not a PRNG key"


def is_global(x: Any) -> bool:
    """Whether orbax can write ``x`` as it is: a ``jax.Array`` of this job's devices.

    With several processes, an array on this process's devices only (a key made
    with ``jax.random.key``, a model never wrapped) is a host-local value: every
    process holds its own, and orbax refuses to write those.
    """
    return isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable)


def stored(leaves: dict[str, Any]) -> dict[str, Any]:
    """What orbax writes for ``leaves``, key by key.

    Global ``jax.Array`` s (PRNG keys as their key data) are written as they are:
    every shard once, by the process that holds it, however the array is laid
    out. Everything else (numpy arrays, numbers, host-local arrays) becomes a
    numpy copy, which orbax writes from process 0 alone.
    """
    out = {}
    for key, leaf in leaves.items():
        value = jax.random.key_data(leaf) if is_key(leaf) else leaf
        out[key] = value if is_global(leaf) else np.array(first_replica(value), copy=True)
    return out


def target(leaf: Any) -> tuple[Any, Any]:
    """``(item, restore args)``: what to read into ``leaf``'s place.

    A global ``jax.Array`` is read with its own shape, dtype and sharding
    (replicated state restores replicated; sharded state would restore sharded,
    each process reading only its shards). Anything else is read as numpy.
    """
    if is_global(leaf):
        data = jax.random.key_data(leaf) if is_key(leaf) else leaf
        item = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
        return item, ocp.ArrayRestoreArgs(sharding=data.sharding, global_shape=data.shape,
                                          dtype=data.dtype)
    return np.zeros((), np.int8), ocp.RestoreArgs(restore_type=np.ndarray)


def restored(value: Any, like: Any) -> Any:
    """``value`` (as read) in the form of ``like``, the leaf it replaces.

    PRNG keys are wrapped in ``like``'s implementation; a host-local array goes
    back to its device, a numpy leaf stays numpy, a Python number a Python number.
    A weakly typed scalar (a ``TrainState``'s ``step``, made from the Python ``0``)
    comes back weakly typed, as orbax does not: a step whose argument changed its
    type would compile its program again at the next call.
    """
    if isinstance(like, jax.Array):
        if not is_global(like):
            value = jax.device_put(np.asarray(value), like.sharding)
        if is_key(like):
            return jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
        if like.ndim == 0 and jax.typeof(like).weak_type and not jax.typeof(value).weak_type:
            weak = jax.jit(lambda x: x, out_shardings=like.sharding)(first_replica(value).item())
            return weak if weak.dtype == like.dtype else value
        return value
    host = first_replica(value)
    if type(like) in _PY_KINDS:
        return type(like)(host.item())
    if isinstance(like, np.generic):
        return host.astype(like.dtype)[()]
    return host
