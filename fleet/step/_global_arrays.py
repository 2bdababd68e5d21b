"""Where a step's arguments live: batches as global arrays over ``data``, the
rest replicated on the mesh.

:func:`to_global` is the one path from a process's rows to a global
``jax.Array`` (a step's numpy batch, ``fleet.io``'s loaders); :func:`global_batch`
checks a step's batch argument and places it;
:func:`placed` moves committed arrays made elsewhere (one device, another mesh)
onto the mesh when ``jit`` refuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet._errors import FleetConfigError, FleetTypeError, nth
from fleet.runtime._world import DATA_AXIS, World, world
from fleet.sections import _sharding


def to_global(rows: Sequence[np.ndarray], sharding: NamedSharding) -> list[jax.Array]:
    """This process's rows of each array as global ``jax.Array`` s sharded by
    ``sharding`` (over ``data``): fleet's one path from local rows to a global
    array, in one batched transfer (``jax.make_array_from_process_local_data``).
    With one process the rows are the whole array."""
    return list(jax.make_array_from_process_local_data(sharding, list(rows)))


def global_batch(position: int, value: Any, w: World) -> Any:
    """Argument ``position`` of a step (batch data) as the global ``jax.Array``
    the step takes, sharded over ``data``: this process's rows in a multi-process
    job (numpy), the global batch otherwise; a batch that does not split evenly
    over the replicas is refused."""
    multiprocess = jax.process_count() > 1

    def check(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.dtype.kind not in "biufc":
            raise FleetTypeError(
                f"{nth(position)} is a numpy array of dtype {x.dtype} (shape "
                f"{x.shape}); a step takes numbers (bool, int, float, complex arrays): "
                "strings and objects cannot enter a JAX program. Keep them out of the "
                "step's arguments (fleet.io's DataLoader leaves them on the host)"
            )
        is_local = multiprocess and not (isinstance(x, jax.Array) and not x.is_fully_addressable)
        replicas = w.num_local_replicas if is_local else w.num_replicas
        shape = tuple(np.shape(x))
        if shape and shape[0] == 0:
            raise FleetConfigError(
                f"{nth(position)} is a batch of 0 rows (shape {shape}); "
                "a step needs at least one row per replica: skip empty batches, or use "
                "drop_last=True in the sampler"
            )
        if not shape or shape[0] % replicas:
            what = "process-local" if is_local else "global"
            if shape == (2,) and getattr(x, "dtype", None) == np.uint32:
                raise FleetConfigError(
                    f"{nth(position)} is a uint32 array of shape (2,), a raw PRNG key "
                    "(jax.random.PRNGKey), which the step would take as batch rows: pass a "
                    "typed key instead, jax.random.key(seed) (or jax.random.wrap_key_data("
                    "raw_key)); each replica then draws its own rows of the single-device "
                    "draw")
            raise FleetConfigError(
                f"{nth(position)} is split over replicas along its leading axis, but "
                f"its {what} shape {shape} has a leading axis that is not "
                f"a multiple of the {replicas} replicas; use a batch size that is a "
                f"multiple of {replicas} (or drop_last=True in the sampler), or pass "
                "batch_argnums to distributed_step if this argument is not batch data"
            )
        if is_local:
            return jax.make_array_from_process_local_data(w.batch, np.asarray(x))
        if isinstance(x, jax.Array) and x.sharding != w.batch:
            return jax.device_put(x, w.batch)
        return x

    if isinstance(value, (jax.Array, np.ndarray)):  # one array: no tree to map
        return check(value)
    return jax.tree.map(check, value)


def placed(state: list, per_replica: Sequence[bool], trees: Any, repl: Any) -> tuple | None:
    """The state, tree and replicated arguments placed on the mesh, or ``None``
    when every array is already where the step expects it."""
    w = world()
    data = NamedSharding(w.mesh, P(DATA_AXIS))
    misplaced = []

    def place(x: Any, where: NamedSharding) -> Any:
        # Only a committed jax.Array can be refused: jit places anything else itself.
        if not isinstance(x, jax.Array) or x.sharding.is_equivalent_to(where, x.ndim):
            return x
        misplaced.append(x)
        return jax.device_put(x, where)

    repl = jax.tree.map(lambda x: place(x, w.replicated), repl)
    trees = jax.tree.map(
        lambda x: _sharding.Shard(place(x.value, data), x.layout)
        if _sharding.is_shard(x) else place(x, w.replicated),
        trees, is_leaf=_sharding.is_shard)
    state = [x if pr else place(x, w.replicated)
             for x, pr in zip(state, per_replica)]
    return (state, trees, repl) if misplaced else None
