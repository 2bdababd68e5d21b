"""``strategy.recompute``: the named sub-modules run under ``nnx.remat``.

Backward then recomputes their activations instead of keeping them
(``jax.checkpoint`` with a ``jax.checkpoint_policies`` policy;
``enable_offload``: the host offload policy, :func:`_policy`). Gradients do not
change; activation memory drops.

Wrapping gives each named sub-module a subclass of its own type,
``Recompute<its class>``, whose ``__call__`` runs the original one under
``nnx.remat`` (``isinstance`` still holds, its class is the base, and the state
keeps its paths). The class changes through :func:`fleet._compat.set_class`, the
one documented point where fleet changes the class of an object it did not
create: Python calls a module through its type, so a sub-module's call can only
be caught by its class or by its parent's attribute, and a wrapper module in
the parent would add a level to every state path and checkpoint key. Inside a step, the parameters enter
the rematerialised call already synced: the wrapped model's buckets, read
outside the checkpoint, are what the sub-module sees, so the gradient
reduction stays in fleet's buckets and out of the recomputed region.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from fleet import _compat
from fleet._errors import FleetConfigError
from fleet.comm import _sync, _synced
from fleet.runtime._leaves import dotted

_TYPES: dict[type, type] = {}


def _policy(name: str) -> Any:
    """The ``jax.checkpoint_policies`` policy named by ``RecomputeConfigs.remat_policy``:
    ``recompute_configs.enable_offload`` saves the matmul outputs without batch
    dimensions in pinned host memory, on every backend that has one (CPU too)."""
    if name == "offload_dot_with_no_batch_dims":
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return getattr(jax.checkpoint_policies, name)


def _remat_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    base = type(self).__fleet_base__
    trace = _sync.current()
    if trace is None:
        return base.__call__(self, *args, **kwargs)
    policy = _policy(self.__fleet_policy__)
    with _synced.synced_as_raw(self):  # the synced values go in, read outside the checkpoint
        return nnx.remat(lambda m, *a, **k: base.__call__(m, *a, **k), policy=policy)(
            self, *args, **kwargs)


def install(model: nnx.Module, checkpoints: tuple[str, ...], policy: str) -> None:
    """Turns each named sub-module of ``model`` into its recomputed type, in place."""
    modules = {dotted(path): m for path, m in nnx.iter_modules(model) if path}
    missing = [c for c in checkpoints if c not in modules]
    if missing:
        raise FleetConfigError(
            f"recompute_configs.checkpoints names {missing}, which {type(model).__name__} "
            f"does not have; its sub-modules are: {', '.join(list(modules)[:20])}"
            + (" ..." if len(modules) > 20 else "")
        )
    for name in checkpoints:
        module = modules[name]
        cls = type(module)
        if getattr(cls, "__fleet_base__", None) is None:
            sub = _TYPES.get((cls, policy))
            if sub is None:
                sub = type(f"Recompute{cls.__name__}", (cls,), {
                    "__call__": _remat_call, "__fleet_base__": cls, "__fleet_policy__": policy})
                _TYPES[(cls, policy)] = sub
            _compat.set_class(module, sub)
