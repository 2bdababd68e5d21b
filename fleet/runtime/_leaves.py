"""A pytree's leaves by dotted name, and brought to the host.

Pure helpers every layer uses: fleet's one dotted name for a leaf's path
(``"layers.0.kernel"``), a typed PRNG key told apart, a leaf brought to the host
(keys as their key data) and an NNX object's variables and values by name. No
fleet import: a message anywhere can name a leaf without pulling in the world.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def dotted(path: tuple) -> str:
    """``"layers.0.kernel"`` for a path: a JAX key path (dict keys, indices,
    attributes) or an NNX path (strings and ints). fleet's one dotted name."""
    parts = []
    for key in path:
        if isinstance(key, (str, int)):
            parts.append(str(key))
            continue
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array."""
    return jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def first_replica(x: Any) -> np.ndarray:
    """``x`` on the host: a replicated array's first local copy, else the whole array
    (an array sharded over other processes cannot be taken to one host)."""
    if isinstance(x, jax.Array) and x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError("a sharded array cannot be taken to one host")
    return np.asarray(x)


def to_host(x: Any) -> np.ndarray:
    """``x`` on the host (:func:`first_replica`), PRNG keys as their key data."""
    return first_replica(jax.random.key_data(x) if is_key(x) else x)


def like(current: Any, data: Any) -> Any:
    """``data`` (on the host or placed) as a value like ``current``: PRNG key data
    wrapped as ``current``'s keys, anything else as it is."""
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(current)) if is_key(current) else data


def variables_of(tree: Any) -> list[tuple[tuple, nnx.Variable]]:
    """The NNX variables in ``tree`` that hold arrays, each with its key path. A
    variable of no array (optax's ``MaskedNode``, which a masked or partitioned
    optimizer such as ``optax.contrib.muon`` keeps for the parameters it leaves to
    another part) is structure: ``tree``'s treedef holds it."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return [(p, v) for p, v in flat if isinstance(v, nnx.Variable) and jax.tree.leaves(v)]


def module_variables(module: nnx.Pytree) -> dict[str, nnx.Variable]:
    """The object's variables by dotted path (``"linear1.kernel"``)."""
    flat = nnx.to_flat_state(nnx.state(module))
    return {dotted(path): var for path, var in flat if jax.tree.leaves(var)}  # (variables_of)


def state_dict(obj: nnx.Pytree) -> dict[str, np.ndarray]:
    """Every variable of ``obj`` as a host array, by dotted path (PRNG keys as key data)."""
    return {k: to_host(v.get_value()) for k, v in module_variables(obj).items()}
