"""The single-device reference of ``fleet.step._verify``: where it runs (this
process's first device of the mesh, or the host), the ``nnx.jit`` of the user's
step, and one run of it on copies of the call's arguments, plain or perturbed
(moved out of ``_verify.py``, which decides which calls are verified and
compares; the noise floor and the perturbation are described there)."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fleet.runtime._leaves import dotted, variables_of
from fleet.runtime._world import world
from fleet.step import _roles
from fleet.step import _verify_sections as sections
from fleet.step._verify_compare import plain, whole
from fleet.wrappers._distributed_optimizer import DistributedOptimizer
from fleet.wrappers._distributed_tx import AllReduceThen


def _nbytes(values: list, kinds: tuple) -> int:
    leaves = [x for v, k in zip(values, kinds) if k != _roles.STATIC
              for x in jax.tree.leaves(nnx.state(v) if k == _roles.NNX else v)]
    return sum(int(np.prod(np.shape(x))) * jnp.result_type(x).itemsize
               for x in leaves if _roles.is_array(x) and not jax.dtypes.issubdtype(
                   jnp.result_type(x), jax.dtypes.prng_key))


def device(w: Any, values: list, kinds: tuple) -> tuple[Any, str]:
    """This process's first device of the mesh, or the host where state and batch, three times
    over (plain, perturbed, outputs), do not fit in its free memory."""
    device = next(d for d in w.mesh.devices.flat if d.process_index == jax.process_index())
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        need = 3 * _nbytes(values, kinds)
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if need > free:
            host = jax.devices("cpu")[0]
            return host, (f"{host}: state and batch x3 = {need / 2**20:.0f} MiB do not fit in "
                          f"{device}'s free {free / 2**20:.0f} MiB")
    return device, str(device)


def reference_fn(fn: Any, kinds: tuple, kw_names: tuple) -> Any:
    """``nnx.jit`` of the user's step over its non-static arguments (the static
    ones, part of the plan, are bound by position)."""
    n_pos = len(kinds) - len(kw_names)

    def call(statics: tuple, dynamic: list, sums: dict, mode: tuple) -> Any:
        st, dy = iter(statics), iter(dynamic)
        values = [next(st) if k == _roles.STATIC else next(dy) for k in kinds]
        return sections.traced(lambda: fn(*values[:n_pos], **dict(zip(kw_names, values[n_pos:]))),
                               sums, mode[1], mode[2])

    return nnx.jit(call, static_argnums=(0, 3))


def _copy(x: Any, device: Any, delta: float | None) -> Any:
    """``x`` on ``device``; float arrays times ``1 + delta`` when perturbed."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        return x
    x = jax.device_put(whole(x), device)
    if delta is False or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if delta is None:
        delta = 2.0 ** -10 if x.dtype.itemsize <= 2 else 2.0 ** -20
    return x * jnp.asarray(1 + delta, x.dtype)


def run(jitted: Any, values: list, kinds: tuple, device: Any, delta: Any, mode: tuple,
         sums: dict) -> tuple:
    """The single-device step on copies (``delta``: False, plain; else the
    perturbation; ``mode`` and ``sums``: accumulated gradients, fleet.step._verify_sections):
    its state leaves (in the step's graph order; keys as key data), its outputs,
    what owns each state leaf, and its new sums."""
    positions = [i for i, k in enumerate(kinds) if k == _roles.NNX]
    objs = tuple(values[i] for i in positions)
    graphdef, state = nnx.split(objs)
    clone = nnx.merge(graphdef, jax.tree.map(lambda x: _copy(x, device, delta), state))
    sections.unshard(clone)  # strategy.sharding: the logical state, plain variables
    for obj in clone:  # the clone's optimizer steps as on one device (no averaging)
        if isinstance(obj, DistributedOptimizer):
            obj.tx = obj.tx.inner
    if mode[0] or mode[1]:
        sections.mark(clone)
    batch_norm = contextlib.nullcontext()
    if world().strategy.sync_batch_norm is False:  # its documented reference
        batch_norm = sections.per_replica_batch_norm(clone, world().mesh.devices.size)
    statics, dynamic = [], []
    for i, (v, k) in enumerate(zip(values, kinds)):
        if k == _roles.STATIC:
            statics.append(v)
        elif k == _roles.NNX:
            dynamic.append(clone[positions.index(i)])
        else:
            dynamic.append(_plain_tx(sections.logical_tree(
                jax.tree.map(lambda x: _copy(x, device, delta), v))))
    with batch_norm:
        out, sums = jitted(tuple(statics), dynamic, sums, mode)
    with_path = variables_of(nnx.split(clone)[1])
    leaves = [plain(v.get_raw_value()) for _, v in with_path]
    owners = ["counter" if isinstance(objs[int(dotted(p[:1]))], nnx.metrics.Metric)
              or not isinstance(v, (nnx.Param, nnx.OptState)) else "state" for p, v in with_path]
    return leaves, out, owners, sums


def _plain_tx(tree: Any) -> Any:
    """A ``TrainState`` holding fleet's distributed transformation, with the
    plain one it wraps instead (it averages over replicas only inside a step)."""
    tx = getattr(tree, "tx", None)
    if isinstance(tx, AllReduceThen) and hasattr(tree, "replace"):
        return tree.replace(tx=tx.inner)
    return tree
