"""``strategy.sharding``: ZeRO stage 1 and 2 on the ``data`` axis (and stage 3's update).

Every parameter-shaped leaf of the optimizer state (Adam's moments, a momentum
trace) is split over ``degree`` replicas: flattened, padded with zeros to
``degree * chunk`` and cut into ``degree`` chunks; replica ``r`` owns chunk
``r % degree``. Outside the step such a leaf is a global ``(replicas, chunk)``
array sharded over ``data`` (each device holds its chunk); inside the step it is
the replica's ``(chunk,)`` slice. Scalars (Adam's count) stay replicated.

One step, inside the per-device body:

1. the wrapped model's bucket backward (:mod:`fleet.comm._sync`,
   :func:`fleet.comm._hooks.zero_backward`) gets each replica's local
   gradients. Stage 2 reduce-scatters them there, bucket by bucket
   (``jax.lax.psum_scatter``), so a bucket's reduced slice is the only
   gradient memory kept past it; stage 1 keeps the whole local gradient and
   reduce-scatters it, in the same buckets, after the backward pass (when the
   optimizer updates; an optimization barrier keeps XLA from scheduling the
   scatters earlier, which would make it stage 2). Both
   hand ``nnx.grad`` / ``jax.grad`` placeholders (zeros): the reduced gradient
   exists only as slices, and a step that reads the placeholders is refused;
2. the optimizer runs the inner optax update on the slices (its own slices of
   the parameters and state). Whole-tensor norms (LAMB / LARS trust ratios,
   ``optax.clip_by_global_norm``) are completed across the slices by
   :mod:`fleet.sections._slices` (a ``psum`` of each sum over a whole slice), without
   touching optax; any other transformation that is not elementwise is
   caught by a probe (:func:`fleet.sections._shard_probe.verify`) before the first step
   and refused;
3. each replica applies its slice of the updates to its slice of the
   parameters, and the new parameters are all-gathered in buckets of
   ``segment_broadcast_MB`` (each bucket a list of slices, not one buffer),
   replicated as in plain data parallelism: as a hand-written ZeRO step, the
   gather writes them where the donated ones were (:func:`local_update`). An
   optax transformation's ``update`` (a Linen ``TrainState``) returns the
   gathered updates instead.

A ``sharding_degree`` below the replica count shards inside groups of that
size and replicates across them; without grouped collectives it reduces with
an all-reduce and gathers over all replicas, so it saves memory but not
traffic.

Checkpoints hold the logical (unsharded) layout
(:func:`fleet.comm._shard_comm.to_logical`, ``to_shards``), so they restore onto
any replica count, with or without sharding.

Stage 3 (:mod:`fleet.sections._stage3`) splits the parameters in the same
layout, so its update is this one on slices it already holds, gathering
nothing. What the update refuses is in :mod:`fleet.sections._shard_refusals`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fleet import _compat
from fleet._errors import FleetError, FleetUnsupportedError
from fleet.comm import _sync
from fleet.comm._buckets import strategy_buckets
from fleet.comm._hooks import reduce_slices
from fleet.comm._shard_comm import Layout, gather, own_slice, to_shards
from fleet.runtime._world import DATA_AXIS, current_strategy, world
from fleet.sections import _finite_replay, _slices
from fleet.sections._shard_refusals import not_the_backwards, sharded_trace


@dataclasses.dataclass(frozen=True)
class Config:
    """The sharding of one step: from ``strategy.sharding_configs`` and the world."""

    stage: int
    degree: int
    replicas: int
    gather_bytes: int
    wire: str | None = None

    def layout(self, shape: Sequence[int]) -> Layout:
        return Layout(tuple(shape), self.degree, self.replicas)


def config(replicas: int | None = None) -> Config | None:
    """The current strategy's sharding (``None`` when ``strategy.sharding`` is off)."""
    strategy = current_strategy()
    if not strategy.sharding:
        return None
    replicas = replicas or world().num_replicas
    cfg = strategy.sharding_configs
    return Config(stage=cfg.stage, degree=cfg.degree(replicas), replicas=replicas,
                  gather_bytes=int(cfg.segment_broadcast_MB * 2**20),
                  wire=strategy_buckets().wire_dtype)


# --------------------------------------------------------------------------- the state


@jax.tree_util.register_pytree_with_keys_class
class Shard:
    """A sharded optimizer-state leaf in an optax state (the ``GradientTransformation``
    path, e.g. a Linen ``TrainState``): ``value`` is the global ``(replicas,
    chunk)`` array outside the step and the replica's ``(chunk,)`` slice inside."""

    __slots__ = ("value", "layout")

    def __init__(self, value: Any, layout: Layout):
        self.value = value
        self.layout = layout

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("value"), self.value),), self.layout

    def tree_flatten(self):
        return (self.value,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: Sequence) -> Shard:
        return cls(children[0], layout)

    def __repr__(self) -> str:
        return f"Shard({getattr(self.value, 'shape', self.value)}, {self.layout})"


def is_shard(x: Any) -> bool:
    return isinstance(x, Shard)


class ShardedState(_sync.PerReplica):
    """Mixin of an NNX optimizer-state variable that fleet shards (variable
    metadata ``fleet_shard``: its :class:`Layout`); its state dict key is the
    unsharded one, so checkpoints carry the logical layout under the same keys."""

    __slots__ = ()


def mark_sharded(variable: nnx.Variable, layout: Layout) -> None:
    _compat.add_mixin(variable, ShardedState, "Sharded")
    variable.set_metadata("fleet_shard", layout)


def layout_of(variable: nnx.Variable) -> Layout | None:
    return variable.get_metadata("fleet_shard") if isinstance(variable, ShardedState) else None


_PROBE_LENGTH = 1_000_003  # a probe parameter i gets this + i elements


def plan(init: Any, params: Any, cfg: Config) -> list[Layout | None]:
    """For each leaf of ``init(params)``: its :class:`Layout` if it is shaped like
    a parameter (sharded), ``None`` if not (kept replicated). Found by
    initialising on probe parameters of distinct lengths; a leaf shaped any
    other way (Adafactor's factored moments) is refused."""
    p_leaves, p_def = jax.tree.flatten(params)
    full = jax.eval_shape(init, params)
    probe = jax.eval_shape(init, jax.tree.unflatten(p_def, [
        jax.ShapeDtypeStruct((_PROBE_LENGTH + i,), jnp.result_type(p))
        for i, p in enumerate(p_leaves)]))
    full_leaves, full_def = jax.tree.flatten(full)
    probe_leaves, probe_def = jax.tree.flatten(probe)
    if full_def != probe_def:
        raise FleetUnsupportedError(
            "strategy.sharding: the optimizer's state changes structure with the "
            "parameters' shapes, so fleet cannot split it; use an optimizer whose state "
            "is shaped like the parameters (sgd, momentum, adam, adamw, lamb, lars...) or "
            "turn strategy.sharding off")
    out: list[Layout | None] = []
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(full)[0]]
    for path, f, q in zip(paths, full_leaves, probe_leaves):
        if f.shape == q.shape:
            out.append(None)
            continue
        i = q.shape[0] - _PROBE_LENGTH if len(q.shape) == 1 else -1
        if not (0 <= i < len(p_leaves) and f.shape == jnp.shape(p_leaves[i])):
            raise FleetUnsupportedError(
                f"strategy.sharding: optimizer state leaf {jax.tree_util.keystr(path)} has "
                f"shape {f.shape}, which is not the shape of a parameter, so fleet cannot "
                "split it (factored or per-row statistics, as in Adafactor); use an "
                "optimizer whose state is shaped like the parameters (adam, sgd, lamb...) "
                "or turn strategy.sharding off")
        out.append(cfg.layout(f.shape))
    return out


def shard_state(state: Any, layouts: list[Layout | None]) -> Any:
    """An optax state (logical) with its parameter-shaped leaves as :class:`Shard` s."""
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, [
        x if lay is None else Shard(to_shards(x, lay), lay) for x, lay in zip(leaves, layouts)])


# --------------------------------------------------------------------------- norms


def _sum_over_slices(x: Any, cfg: Config) -> Any:
    """Sum of a per-slice value over the shard group (each group's slices are
    copies across the ``replicas // degree`` groups)."""
    total = _sync.psum([x])[0]
    copies = jax.lax.axis_size(DATA_AXIS) // cfg.degree
    return total / copies if copies > 1 else total


def sliced_update(inner: Any, cfg: Config, grads: Any, state: Any, state_marks: Any,
                   params: Any, **extra: Any) -> tuple[Any, Any]:
    """``inner.update`` on slices, its whole-tensor norms completed across them
    (:mod:`fleet.sections._slices`): ``state_marks`` says which state leaves are slices."""
    return _slices.run(lambda g, s, p: inner.update(g, s, p, **extra),
                       (grads, state, params), (True, state_marks, True),
                       lambda x: _sum_over_slices(x, cfg))


# --------------------------------------------------------------------------- the update


def local_update(inner: Any, grads: Any, state: Any, params: Any,
                 **extra: Any) -> tuple[Callable, tuple, Callable]:
    """The sharded update of ``inner`` inside a step, in parts: ``core(*args)``,
    the update of this replica's slices (``args``: the reduced gradient slices,
    the state with its :class:`Shard` leaves as slices, the parameter slices),
    which returns the update slices and the new state; and ``finish(updates,
    new_state, keep=None, apply=True)``, which returns the new full parameters
    (the updated parameter slices, gathered; ``None`` without parameters or
    ``apply``: an optax transformation's update), the full updates
    (gathered: only if read, XLA drops them otherwise) and the new state (its
    :class:`Shard` leaves the new slices). ``keep``: ``check_nan_inf``'s replay
    keeps the old parameters where it is false (:mod:`fleet.sections._finite_replay`).

    The new parameters are gathered rather than the updates, as a hand-written
    ZeRO step does: the gather writes them where the donated ones were, while
    gathering the updates and adding them to the full parameters holds the
    gathered updates besides (the MLP of benchmarks/donation.py at stage 2: 84.2
    MB live per device against 78.2 MB). Each element is the same sum either way
    (:func:`_apply`)."""
    trace = sharded_trace()
    cfg: Config = trace.shard.config
    rewrap = _identity
    if params is not None and cfg.stage == 3 and any(map(is_shard, jax.tree.leaves(
            params, is_leaf=is_shard))):  # a Linen model's (fleet.sections._stage3)
        grads, params, rewrap = _unwrap(grads, params)
    g_leaves, g_def = jax.tree.flatten(grads)
    # (stage 3's gradients are its slices' placeholders: their layouts are kept)
    layouts = [trace.shard.layouts.get(id(g)) or cfg.layout(jnp.shape(g)) for g in g_leaves]
    slices = _reduced_slices(trace, grads, params)
    s_leaves, s_def = jax.tree.flatten(state, is_leaf=is_shard)
    inner_state = jax.tree.unflatten(s_def, [x.value if is_shard(x) else x for x in s_leaves])
    p_slices = None
    if params is not None:  # (stage 3 holds its slices already)
        p_slices = params if cfg.stage == 3 else jax.tree.unflatten(g_def, [
            own_slice(p, lay) for p, lay in zip(jax.tree.leaves(params), layouts)])
    marks = jax.tree.unflatten(s_def, [is_shard(x) for x in s_leaves])

    def core(g_slices: Any, sliced_state: Any, p: Any) -> tuple[Any, Any]:
        return sliced_update(inner, cfg, g_slices, sliced_state, marks, p, **extra)

    def full(slices_tree: Any) -> Any:
        return jax.tree.unflatten(g_def, gather(jax.tree.leaves(slices_tree), layouts,
                                                cfg.gather_bytes))

    def finish(updates: Any, new_inner: Any, keep: Any = None, *,
               apply: bool = True) -> tuple[Any, Any, Any]:
        new_state = jax.tree.unflatten(s_def, [
            Shard(v, x.layout) if is_shard(x) else v
            for v, x in zip(jax.tree.leaves(new_inner), s_leaves)])
        new_params = None
        if p_slices is not None and apply:  # (stage 3 keeps its slices)
            new_params = _apply(p_slices, updates, keep)
            new_params = rewrap(new_params) if cfg.stage == 3 else full(new_params)
        return new_params, full(updates) if rewrap is _identity else rewrap(updates), new_state

    return core, (jax.tree.unflatten(g_def, slices), inner_state, p_slices), finish


def _identity(tree: Any) -> Any:
    return tree


def _unwrap(grads: Any, params: Any) -> tuple[Any, Any, Callable]:
    """Stage 3's Linen parameters (:class:`Shard` nodes) and gradients as slices,
    and the function that wraps slices as the parameters are."""
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=is_shard)
    plain = [i for i, x in enumerate(p_leaves) if not is_shard(x)]
    if plain:
        raise FleetError(
            "sharding_configs.stage = 3: some of this optimizer's parameters are split "
            "(fleet.distributed_model(module).init) and some are not; initialise all of "
            "them with the wrapped model's init")

    def rewrap(tree: Any) -> Any:
        return jax.tree.unflatten(p_def, [Shard(v, x.layout)
                                          for v, x in zip(jax.tree.leaves(tree), p_leaves)])

    strip = functools.partial(jax.tree.map, lambda x: x.value if is_shard(x) else x,
                              is_leaf=is_shard)
    return strip(grads), strip(params), rewrap


def _apply(p_slices: Any, updates: Any, keep: Any) -> Any:
    """``optax.apply_updates`` on the slices; with ``keep`` (``check_nan_inf``'s
    replay, :mod:`fleet.sections._finite_replay`), ``where(keep, new, old)`` per slice.

    Each update slice is made whole first (``jax.lax.optimization_barrier``), as
    when the updates were gathered and added to the full parameters: XLA would
    otherwise fuse the update's last product into the sum (one fused
    multiply-add, rounded once) and the new parameters would differ in the last
    bit from that sum (tests/test_memory_select.py). XLA:CPU keeps the barrier
    with fleet's ``--xla_disable_hlo_passes=cse_barrier_expander`` (set where
    JAX runs on CPU only, fleet/runtime/_xla_flags.py); GPU and TPU keep it by themselves."""
    new = optax.apply_updates(p_slices, jax.tree.map(jax.lax.optimization_barrier, updates))
    return new if keep is None else _finite_replay.select(keep, new, p_slices)


def _reduced_slices(trace: _sync.SyncTrace, grads: Any, params: Any) -> list:
    """This replica's slices of the reduced gradients: the wrapped model's
    backward left them (stage 2) or the local gradients (stage 1, reduce-scattered
    here); their finite flags recorded, and float16 amp's agreed flag. A gradient
    the backward did not leave is refused
    (:func:`fleet.sections._shard_refusals.not_the_backwards`)."""
    cfg: Config = trace.shard.config
    g_leaves = jax.tree.leaves(grads)
    found = [trace.shard.grads.get(id(g)) for g in g_leaves]
    missing = [i for i, f in enumerate(found) if f is None]
    if missing:
        not_the_backwards(trace, grads, params, missing, found)
    slices: list = [None] * len(found)
    local = [i for i, (_, value, reduced) in enumerate(found) if not reduced]
    for i, (_, value, reduced) in enumerate(found):
        if reduced:
            slices[i] = value
    if local:  # stage 1: reduce-scatter now, after the whole backward, in the buckets
        # The barrier keeps XLA from moving the scatters into the backward pass
        # (which would be stage 2): stage 1 holds the whole local gradient.
        held = jax.lax.optimization_barrier([found[i][1] for i in local])
        for i, s in zip(local, reduce_slices(held, cfg, trace.tx.divisor)):
            slices[i] = s
    trace.finite.record([f"gradient of {found[i][0]!r}" for i in local],
                        [slices[i] for i in local])
    if trace.tx.loss_scale is not None:  # float16 amp: every shard agrees (psum of the flags)
        bad = sum(jnp.sum(~jnp.isfinite(s)).astype(jnp.int32) for s in slices)
        trace.shard.finite = _sync.psum([bad])[0] == 0
    return slices
