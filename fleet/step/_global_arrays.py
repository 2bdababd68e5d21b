"""Where a step's arguments live: batches as global arrays over ``data``, the
rest replicated on the mesh.

:func:`to_global` is the one path from a process's rows to a global
``jax.Array`` (a step's numpy batch, ``fleet.io``'s loaders); :func:`global_batch`
checks a step's batch argument and places it;
:func:`placed` moves committed arrays made elsewhere (one device, another mesh)
onto the mesh when ``jit`` refuses them.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet._errors import FleetConfigError, FleetError, FleetTypeError, nth
from fleet.runtime._agree import agree
from fleet.runtime._leaves import like, to_host
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


def placed(state: list, per_replica: Sequence[bool], trees: Any, repl: Any,
           first: bool = False) -> tuple | None:
    """The state, tree and replicated arguments placed on the mesh, or ``None``
    when every array is already where the step expects it.

    An array committed elsewhere (one device, another mesh) is placed: ``jit``
    refuses it, and places anything else itself. A plan's ``first`` call also
    places what the next calls will pass placed, so that they find its program in
    ``jit``'s cache (whose key holds each argument's mesh) rather than compile a
    second one: the state, which the step writes back as arrays on the mesh (a
    host value too, and one device's array where the mesh has one device); a
    tree's Python scalars (a new ``TrainState``'s ``step=0``) and arrays, which
    come back so when the step returns the tree (a numpy array is left as it is:
    more often a table that each call passes again). The replicated arguments are
    given anew each call: only what ``jit`` refuses is placed, and a first call's
    leaf of a tree or of the state (``step(state, batch, state.key)``) as that leaf."""
    w = world()
    data = NamedSharding(w.mesh, P(DATA_AXIS))
    todo: list[tuple[Any, NamedSharding]] = []  # (value, where), placed together
    slots: dict[int, _Slot] = {}

    def place(x: Any, where: NamedSharding, returned: tuple[type, ...] = ()) -> Any:
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(where, x.ndim) and (
                    not returned or getattr(x.sharding, "mesh", None) == where.mesh):
                return x
            if not (x.committed or returned):
                return x
        elif not isinstance(x, returned):
            return x
        todo.append((x, where))
        slot = _Slot(len(todo) - 1)
        if isinstance(x, jax.Array):  # (not a scalar: CPython shares small ints)
            slots[id(x)] = slot
        return slot

    scalars = (bool, int, float, complex)
    in_tree = scalars if first else ()
    in_state = (np.ndarray, np.generic, *scalars) if first else ()
    trees = jax.tree.map(
        lambda x: _sharding.Shard(place(x.value, data, in_tree), x.layout)
        if _sharding.is_shard(x) else place(x, w.replicated, in_tree),
        trees, is_leaf=_sharding.is_shard)
    state = [x if pr else place(x, w.replicated, in_state)
             for x, pr in zip(state, per_replica)]
    repl = jax.tree.map(lambda x: slots[id(x)] if id(x) in slots else place(x, w.replicated),
                        repl)
    put = _put(todo, first)
    if put is None:
        return None

    def fill(x: Any) -> Any:
        if _sharding.is_shard(x):
            return _sharding.Shard(fill(x.value), x.layout)
        return put[x.index] if isinstance(x, _Slot) else x

    return ([fill(x) for x in state], jax.tree.map(fill, trees, is_leaf=_sharding.is_shard),
            jax.tree.map(fill, repl))


def _put(todo: list[tuple[Any, NamedSharding]], first: bool) -> list | None:
    """The values of :func:`placed`'s ``todo`` on their shardings, together, or
    ``None`` when there are none. In a multi-process job, values from each
    process's host are placed from its own copy, checked equal on a plan's
    ``first`` call (``jax.device_put`` would check each with a collective)."""
    multi = jax.process_count() > 1
    hosts = {i: _host_copy(x) for i, (x, _) in enumerate(todo) if multi and _host_local(x)}
    if first and multi:
        _check_same(list(hosts.values()))
    if not todo:
        return None
    return [like(x, jax.make_array_from_callback(hosts[i].shape, where,
                                                 lambda idx, h=hosts[i]: h[idx]))
            if i in hosts else jax.device_put(x, where) for i, (x, where) in enumerate(todo)]


class _Slot:
    """Where :func:`placed` puts its ``index``-th placed value."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _host_local(x: Any) -> bool:
    """Whether placing ``x`` on a global sharding transfers this process's copy (a
    host array, an uncommitted array), which ``jax.device_put`` would check against
    the other processes' leaf by leaf. Python scalars and weak-typed arrays are left
    to it: it keeps their weak type, which jit's cache key holds."""
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    return (isinstance(x, jax.Array) and not x.committed and x.is_fully_addressable
            and not getattr(x, "weak_type", False))


def _host_copy(x: Any) -> np.ndarray:
    """This process's copy of a host-local value, in the dtype ``jax.device_put``
    would give it (PRNG keys as their key data)."""
    host = to_host(x)
    return host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)


def _check_same(local: list[np.ndarray]) -> None:
    """Every process passed the same host-local values to a plan's first call: one
    agreement of their checksums (``jax.device_put`` checks each leaf with a
    collective of its own: 2 ms a leaf on gloo, 1.5 s of a 782-leaf TrainState's
    first call in a two-process job). Collective: every process calls it at its
    plan's first call."""
    sums = [zlib.crc32(np.ascontiguousarray(h).tobytes()) for h in local]
    tables = [json.loads(t) for t in agree("the first call's arguments", json.dumps(sums))]
    if all(t == tables[0] for t in tables):
        return
    n = min(map(len, tables))
    i = next((i for i in range(n) if any(t[i] != tables[0][i] for t in tables)), n)
    what = (f"array {i + 1} of the {len(local)} it places from each process's host "
            f"({local[i].dtype}{list(local[i].shape)})" if i < len(local)
            else "the number of arrays it places from each process's host")
    raise FleetError(
        f"the processes passed different values to the step's first call: {what} differs "
        "between them. Replicated state must be the same on every process: build it from "
        "the same seed, or wrap the model (fleet.distributed_model), which takes process "
        "0's values")
