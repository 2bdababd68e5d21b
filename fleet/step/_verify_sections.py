"""The strategy sections ``fleet.step._verify``'s single-device reference mirrors.

``strategy.sharding``: a sharded optimizer-state leaf (an NNX variable marked
``ShardedState``, or a :class:`fleet.sections._sharding.Shard` in a Linen
``TrainState``) is a ``(replicas, chunk)`` array; both sides are compared in
its logical layout (the parameter's shape, as a checkpoint holds it). The
reference's clone gets the logical values as plain variables, and runs the
inner transformation on one device.

Accumulated gradients (``no_sync``, ``strategy.gradient_merge``): fleet keeps
per-replica local sums (``grad_accum``), which have no single-device value. The
reference keeps its own single-device sum instead, across the calls it checks:
an accumulating call (inside ``no_sync``, or a ``gradient_merge`` call before
the ``k_steps``-th) adds the global-batch gradient to it and does not step
(parameters, optimizer state and ``step`` are compared: unchanged on both
sides); the call that applies them (the ``k_steps``-th, or the first synced call
after ``no_sync`` ones) steps with ``(sum + its gradient)``, divided by
``k_steps`` under ``gradient_merge_configs.avg``: ``optax.MultiSteps`` on one
device. The plain and the perturbed reference each keep their own sum, so the
floor covers the drift of the whole accumulation. A sum that began before
verify saw it (a restored mid-cycle checkpoint, calls past the k verified ones)
cannot be rebuilt: such calls are skipped, and said.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fleet import _compat
from fleet.comm import _sync, _synced
from fleet.runtime._leaves import module_variables
from fleet.sections import _batch_norm, _sharding, _stage3
from fleet.step._verify_compare import whole
from fleet.wrappers._distributed_optimizer import DistributedOptimizer

# -- strategy.sharding --------------------------------------------------------------------


def logical(x: Any, layout: Any) -> Any:
    """A sharded leaf's whole ``(replicas, chunk)`` value in the parameter's shape."""
    return x[:layout.degree].reshape(-1)[:layout.size].reshape(layout.shape)


def fleet_value(var: nnx.Variable) -> Any:
    """What the distributed step holds in ``var``, whole and logical."""
    layout = _sharding.layout_of(var)
    value = whole(var.get_raw_value())
    return value if layout is None else logical(np.asarray(value), layout)


def logical_tree(tree: Any) -> Any:
    """A pytree (a ``TrainState``) with its :class:`Shard` nodes as logical arrays."""
    return jax.tree.map(lambda s: logical(whole(s.value), s.layout) if _sharding.is_shard(s)
                        else s, tree, is_leaf=_sharding.is_shard)


def unshard(objs: tuple) -> None:
    """The reference's clones: sharded variables get their logical value and their
    own class back, so the optimizer updates them as one device does."""
    for obj in objs:
        if getattr(obj, "params_split", False):  # stage 3's optimizer: whole parameters now
            obj.params_split = False
        for var in module_variables(obj).values():
            layout = _sharding.layout_of(var)
            if layout is None:
                continue
            value = logical(var.get_raw_value(), layout)
            if _synced.layout_of(var) is not None:  # stage 3's parameter: synced as at stage 0
                _stage3.make_whole(var, value)
            var.set_raw_value(value)
            base = next(c for c in type(var).__mro__[1:] if not issubclass(c, _sync.PerReplica))
            _compat.set_class(var, base)


# -- no_sync and gradient_merge ------------------------------------------------------------

_BOX: list[dict] = []  # while the reference traces: its sums in, the new sums out


def _update(self: Any, model: Any, grads: Any, /, **kwargs: Any) -> Any:
    """The reference's distributed optimizer on an accumulating or applying call:
    adds the gradients to the reference's sum; steps with it (divided by
    ``k_steps``) only on the applying call."""
    box = _BOX[-1]
    slot = self.verify_slot
    state = nnx.state(grads, self.wrt, graph=self.graph)
    total = nnx.as_pure(state)
    if box["sums"].get(slot) is not None:
        total = jax.tree.map(jnp.add, box["sums"][slot], total)
    if not box["apply"]:
        box["out"][slot] = total
        return None
    box["out"][slot] = None
    total = jax.tree.map(lambda g: g / jnp.asarray(box["divisor"], g.dtype), total)
    total = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(total))
    return nnx.Optimizer.update(self, model, total, **kwargs)


def traced(fn: Any, sums: dict, apply: bool, divisor: float) -> tuple[Any, dict]:
    """Runs ``fn()`` (the user's step, while the reference traces) with the sums
    the accumulating optimizers read; returns its output and their new sums."""
    _BOX.append({"sums": sums, "apply": apply, "divisor": divisor, "out": dict(sums)})
    try:
        out = fn()
        return out, _BOX[-1]["out"]
    finally:
        _BOX.pop()


class Accumulation:
    """One step's record of the gradients accumulated across calls (see the
    module docstring): ``"none"``, ``"tracked"`` (``sums``: per optimizer slot,
    plain and perturbed) or ``"lost"`` (accumulated where verify did not see)."""

    def __init__(self) -> None:
        self.status = "none"
        self.sums: tuple[dict, dict] = ({}, {})
        self.seen = False

    def idle(self, plan: Any) -> bool:
        """Whether a call of ``plan`` leaves the record as it is when not checked: no
        sum is followed and the call neither adds to one nor applies one."""
        return (self.seen and self.status == "none" and not plan.no_sync
                and plan.grad_merge is None)

    def mode(self, plan: Any, objs: tuple, verified: bool) -> tuple | None:
        """This call's ``(accumulates, applies, divisor)``; ``None`` where it
        cannot be checked (the sum it adds to or applies is not known).
        ``verified``: whether the call would be checked; if not, the record
        follows it."""
        if not self.seen:  # a restored checkpoint may hold a sum begun elsewhere
            self.seen = True
            if any(_holds_a_sum(o) for o in objs):
                self.status = "lost"
        opts = [o for o in objs if isinstance(o, DistributedOptimizer)]
        accumulates = bool(plan.no_sync) and bool(opts)
        applies = not plan.no_sync and (plan.grad_merge == "final" or self.status != "none")
        divisor = max([o.merge.k_steps for o in opts if o.merge is not None and o.merge.avg
                       and plan.grad_merge == "final"], default=1)
        if not verified or (self.status == "lost" and (accumulates or applies)):
            self.status = "lost" if accumulates else "none" if applies else self.status
            return None
        return accumulates, applies, divisor

    def done(self, accumulates: bool, applies: bool, new: tuple[dict, dict]) -> None:
        """After a checked call: the reference's new sums (plain, perturbed)."""
        if accumulates:
            self.status, self.sums = "tracked", new
        elif applies:
            self.status, self.sums = "none", ({}, {})


_TYPES: dict[type, type] = {}  # a distributed optimizer's class -> its reference's


def mark(clone: tuple) -> None:
    """The reference's distributed optimizers accumulate (their slot: their index)."""
    for i, obj in enumerate(clone):
        if isinstance(obj, DistributedOptimizer):
            cls = type(obj)
            if cls not in _TYPES:
                _TYPES[cls] = type(f"Verify{cls.__name__}", (cls,), {"update": _update})
            _compat.set_class(obj, _TYPES[cls])
            obj.verify_slot = i


def _holds_a_sum(obj: Any) -> bool:
    """Whether a distributed optimizer is mid-way through a sum (its merge count
    or its accumulator not zero)."""
    if not isinstance(obj, DistributedOptimizer):
        return False
    merge = obj.fleet_state.merge
    if merge is not None and int(np.asarray(whole(merge.mini_step.get_raw_value()))) != 0:
        return True
    accum = getattr(obj, "grad_accum", None)
    if accum is None:
        return False
    return any(np.any(np.asarray(jax.device_get(whole(v.get_raw_value()))) != 0)
               for v in module_variables(accum).values())


# -- strategy.sync_batch_norm = False ------------------------------------------------------

def _per_replica_call(self: Any, x: Any, use_running_average: bool | None = None,
                      **kwargs: Any) -> Any:
    """An ``nnx.BatchNorm`` of the reference with fleet's documented per-replica
    statistics: in training, the batch's rows in ``__fleet_groups__`` equal groups
    (the replicas' rows, in order), each normalised by the layer's own call with
    its own statistics from the same running ones; the running statistics then
    the groups' mean, as fleet averages the replicas' (``fleet.step._graph.running_statistics``)."""
    base, n = type(self).__fleet_base__, type(self).__fleet_groups__
    frozen = self.use_running_average if use_running_average is None else use_running_average
    if frozen or n == 1:
        return base.__call__(self, x, use_running_average=use_running_average, **kwargs)
    start = (self.mean[...], self.var[...])
    outs, stats = [], []
    for rows in jnp.split(x, n):
        self.mean[...], self.var[...] = start
        outs.append(base.__call__(self, rows, use_running_average=use_running_average, **kwargs))
        stats.append((self.mean[...], self.var[...]))
    self.mean[...] = sum(m for m, _ in stats) / n
    self.var[...] = sum(v for _, v in stats) / n
    return jnp.concatenate(outs)


_PER_REPLICA: dict = {}  # (class, replicas) -> its per-replica subclass


def per_replica_batch_norm(clone: Any, replicas: int) -> Any:
    """The reference's BatchNorm layers normalise each replica's rows apart
    (``strategy.sync_batch_norm = False``, fleet's one documented difference from
    one device): the clone's ``nnx.BatchNorm`` layers by :func:`_per_replica_call`;
    a wrapped Linen module's ``nn.BatchNorm`` layers while the returned context is
    open (:func:`fleet.sections._batch_norm.per_replica_reference`)."""
    for _, node in nnx.iter_graph(clone):
        cls = type(node)
        if isinstance(node, nnx.BatchNorm) and "__fleet_groups__" not in vars(cls):
            key = (cls, replicas)
            if key not in _PER_REPLICA:
                _PER_REPLICA[key] = type(f"PerReplica{cls.__name__}", (cls,), {
                    "__call__": _per_replica_call, "__fleet_base__": cls,
                    "__fleet_groups__": replicas})
            _compat.set_class(node, _PER_REPLICA[key])
    return _batch_norm.per_replica_reference(replicas)
