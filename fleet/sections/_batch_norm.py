"""``strategy.sync_batch_norm``: a wrapped model's BatchNorm layers in a step (NNX and Linen).

In a data-parallel step each replica sees its own rows, and a BatchNorm in
training mode normalises with the statistics of the rows it sees. fleet does
not guess which the user wants:

* ``True`` (Paddle's ``sync_batch_norm``, torch's ``SyncBatchNorm``): the
  statistics of the global batch. Inside a step each such layer runs with
  Flax's own ``axis_name`` set to the ``data`` axis (its batch mean and mean of
  squares averaged over the replicas: one small all-reduce per layer), in a
  ``jit`` named ``fleet_batch_norm``, which the step's guards know as fleet's.
  Its parameters go in already synced (read outside the ``jit``, as the
  wrapped model's buckets give them), so their gradients are averaged like any
  other. The step then equals the single-device step: loss, parameters,
  running statistics, evaluation outputs.
* ``False``: DDP's per-replica statistics, chosen explicitly. Each replica
  normalises with its own rows; the running statistics leave the step averaged
  over the replicas, so they stay equal everywhere. The one deliberate
  difference from one device.
* not set (``None``, the default): the first call of a step that runs a
  BatchNorm in training mode raises, naming the layer and the two choices.

Outside a step, and in evaluation mode (``use_running_average``), a layer runs
as Flax's.

A Linen ``nn.BatchNorm`` keeps its fields, so its choice is read at each call
(:func:`linen_interceptor`, through Flax's public ``nn.intercept_methods``):
``axis_name=fleet.DATA_AXIS`` written in the layer, or ``sync_batch_norm``, picks
the same two behaviours; the layer then runs as a pure Linen ``apply`` of a
clone of itself in the same ``fleet_batch_norm`` ``jit``, and its new running
statistics are written back into the caller's ``batch_stats``. Another
``axis_name`` (``"batch"``, kept from a ``jax.pmap`` script), or no choice at
all, raises with what to write. The layers change class at wrapping (``Sync<cls>`` or
``Checked<cls>``, subclasses of their own) through
:func:`fleet._compat.set_class`, the one documented point where fleet changes
the class of an object it did not create; the class carries the layer's path,
for the message.

verify's reference (``fleet.step._verify``) runs the user's step on one device. Under
:func:`per_replica_reference` a Linen layer that would run with per-replica
statistics in the step (``sync_batch_norm = False``, no ``axis_name``) runs there
as the documented reference: the batch split into the replicas' rows, each
normalised apart from the same running statistics, the new ones averaged.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from fleet import _compat
from fleet._errors import FleetError
from fleet.comm import _sync, _synced
from fleet.runtime._leaves import dotted
from fleet.runtime._world import DATA_AXIS

_TYPES: dict[tuple[type, str, bool | None], type] = {}
_IN_CLONE = contextvars.ContextVar("fleet_linen_batch_norm_clone", default=False)
_GROUPS = contextvars.ContextVar("fleet_linen_batch_norm_groups", default=1)


def _training(layer: nnx.BatchNorm, kwargs: dict) -> bool:
    use = kwargs.get("use_running_average")
    use = layer.use_running_average if use is None else use
    return not use


def _sync_call(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    base = type(self).fleet_base
    if _sync.current() is None or not _training(self, kwargs):
        return base.__call__(self, x, *args, **kwargs)

    def fleet_batch_norm(layer, x):
        return base.__call__(layer, x, *args, **kwargs)

    axis_name = self.axis_name
    self.axis_name = DATA_AXIS
    try:
        with _synced.synced_as_raw(self):  # the synced values go in, read outside the jit
            return nnx.jit(fleet_batch_norm)(self, x)
    finally:
        self.axis_name = axis_name


def _checked_call(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    base = type(self).fleet_base
    if _sync.current() is not None and _training(self, kwargs):
        raise FleetError(
            f"the wrapped model's BatchNorm layer {type(self).fleet_layer!r} "
            f"({base.__module__}.{base.__name__}) runs in training mode in a data-parallel "
            "step, where each replica sees only its own rows, and fleet does not guess "
            "how it should normalise. Choose one, before fleet.distributed_model:\n"
            "  strategy.sync_batch_norm = True   # statistics over the global batch: equal "
            "to one device, one small all-reduce per layer\n"
            "  strategy.sync_batch_norm = False  # DDP's per-replica statistics (the "
            "running statistics averaged over replicas)"
        )
    return base.__call__(self, x, *args, **kwargs)


def install(model: nnx.Module, choice: bool | None) -> int:
    """Gives each ``nnx.BatchNorm`` of ``model`` its step behaviour for ``choice``
    (``strategy.sync_batch_norm``), in place; returns how many layers changed."""
    if choice is False:
        return 0
    changed = 0
    for path, module in nnx.iter_modules(model):
        cls = type(module)
        if not isinstance(module, nnx.BatchNorm) or hasattr(cls, "fleet_base"):
            continue
        name = dotted(path) or type(model).__name__
        sub = _TYPES.get((cls, name, choice))
        if sub is None:
            prefix, call = ("Sync", _sync_call) if choice else ("Checked", _checked_call)
            sub = type(f"{prefix}{cls.__name__}", (cls,), {
                "__call__": call, "fleet_base": cls, "fleet_layer": name,
                "__module__": __name__})
            _TYPES[(cls, name, choice)] = sub
        _compat.set_class(module, sub)
        changed += 1
    return changed


def unwrapped_in_training(objs: tuple, names: list[str]) -> str:
    """What to write for the first ``nnx.BatchNorm`` in training mode that no wrapped
    model converted (``install``), among the step's objects ``objs`` (``names``:
    how the message calls each): its statistics are of the replica's rows. Empty
    where there is none."""
    for obj, name in zip(objs, names):
        if not isinstance(obj, nnx.Module):
            continue
        for path, module in nnx.iter_modules(obj):
            if (isinstance(module, nnx.BatchNorm) and not hasattr(type(module), "fleet_base")
                    and not module.use_running_average):
                return (f" Here: the BatchNorm layer {dotted(path) or type(module).__name__!r} "
                        f"of {name} runs in training mode, its batch statistics of the "
                        "replica's rows, and no wrapped model holds it: wrap the module with "
                        "fleet.distributed_model (strategy.sync_batch_norm then applies), "
                        "or, if it is frozen, put it in evaluation mode (.eval()) before "
                        "the step.")
    return ""


def linen_interceptor(choice: bool | None) -> Any:
    """The ``nn.intercept_methods`` interceptor that runs each Linen ``nn.BatchNorm``
    of a wrapped module in a step, for ``choice`` (``strategy.sync_batch_norm``)."""

    def intercept(next_fun: Any, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        if (not isinstance(module, linen.BatchNorm) or context.method_name != "__call__"
                or module.is_initializing() or _IN_CLONE.get()):
            return next_fun(*args, **kwargs)
        given = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
        if linen.merge_param("use_running_average", module.use_running_average, given):
            return next_fun(*args, **kwargs)
        if _sync.current() is None:  # one device (init, a reference): the global batch
            if module.axis_name == DATA_AXIS:
                return _run_linen(module, args[0], kwargs, axis_name=None, average=False)
            if choice is False and module.axis_name is None and _GROUPS.get() > 1:
                return _run_linen(module, args[0], kwargs, axis_name=None, average=True,
                                  groups=_GROUPS.get())
            return next_fun(*args, **kwargs)
        path = "/".join(module.scope.path) if module.scope is not None else module.name
        if module.axis_name not in (None, DATA_AXIS):
            raise FleetError(
                f"the Linen BatchNorm {path!r} has axis_name={module.axis_name!r}, which is "
                f"not an axis of fleet's step (kept from a jax.pmap script?). Write "
                f"axis_name=fleet.DATA_AXIS ({DATA_AXIS!r}) for statistics over the global "
                "batch (equal to one device), or axis_name=None with "
                "strategy.sync_batch_norm = False for DDP's per-replica statistics")
        if module.axis_name == DATA_AXIS or choice:
            return _run_linen(module, args[0], kwargs, axis_name=DATA_AXIS, average=False)
        if choice is False:
            return _run_linen(module, args[0], kwargs, axis_name=None, average=True)
        raise FleetError(
            f"the Linen BatchNorm {path!r} runs in training mode in a data-parallel step, "
            "where each replica sees only its own rows, and fleet does not guess how it "
            "should normalise. Choose one:\n"
            "  nn.BatchNorm(..., axis_name=fleet.DATA_AXIS)  # statistics over the global "
            "batch: equal to one device, one small all-reduce per layer (or set "
            "strategy.sync_batch_norm = True)\n"
            "  strategy.sync_batch_norm = False  # DDP's per-replica statistics (the "
            "running statistics averaged over replicas)")

    return intercept


@contextlib.contextmanager
def per_replica_reference(replicas: int):
    """While open, a Linen layer with per-replica statistics in a step runs, outside
    any step, as ``replicas`` groups of rows (verify's single-device reference)."""
    token = _GROUPS.set(replicas)
    try:
        yield
    finally:
        _GROUPS.reset(token)


def _run_linen(module: linen.BatchNorm, x: Any, kwargs: dict, *, axis_name: str | None,
               average: bool, groups: int = 1) -> Any:
    """``module`` in training mode as a pure ``apply`` of a clone with ``axis_name``,
    in the ``fleet_batch_norm`` ``jit``; its new running statistics (averaged over
    the replicas when ``average``) written back into ``module``'s scope. With
    ``groups`` > 1 (one device), the rows split in that many equal groups, each
    normalised apart, the running statistics averaged over the groups."""
    clone = module.clone(parent=None, axis_name=axis_name, use_running_average=None)
    variables = module.variables
    mask = kwargs.get("mask")

    def normalise(variables, x, mask):
        token = _IN_CLONE.set(True)  # the clone runs as Flax's
        try:
            return clone.apply(variables, x, use_running_average=False, mask=mask,
                               mutable=["batch_stats"])
        finally:
            _IN_CLONE.reset(token)

    def fleet_batch_norm(variables, x, mask):
        if groups > 1:
            masks = [None] * groups if mask is None else jnp.split(mask, groups)
            parts = [normalise(variables, rows, m)
                     for rows, m in zip(jnp.split(x, groups), masks)]
            y = jnp.concatenate([y for y, _ in parts])
            return y, jax.tree.map(lambda *v: sum(v) / groups, *[u for _, u in parts])
        y, updates = normalise(variables, x, mask)
        if average:
            updates = jax.tree.map(lambda v: jax.lax.pmean(v, DATA_AXIS), updates)
        return y, updates

    y, updates = jax.jit(fleet_batch_norm)(variables, x, mask)
    for name, value in updates.get("batch_stats", {}).items():
        module.put_variable("batch_stats", name, value)
    return y
