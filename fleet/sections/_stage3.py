"""``sharding_configs.stage = 3``: ZeRO stage 3 (Paddle's ``level="p_g_os"``,
torch's FSDP): the parameters are split too.

At the first step, where the distributed optimizer splits its state
(:mod:`fleet.sections._sharding`, stages 1 and 2), it also splits the
parameters of the wrapped model it updates, in the same layout as their
state (:func:`shard_parameters`): each is stored as the global ``(replicas,
chunk)`` array of the replicas' slices, flattened and zero padded, so each
device holds ``1/degree`` of its bytes. Inside a step the model reads them
whole: gathered in buckets where it reads them, their gradients
reduce-scattered on the way back (:mod:`fleet.comm._param_gather`); the
optimizer updates each replica's slices and gathers nothing.

Outside a step a parameter still reads as the user's: ``variable[...]``,
``variable.get_value()``, ``model(x)`` and ``fleet.save`` see the whole array
(gathered at each read), and writing one splits it again
(:class:`fleet.comm._synced.SyncedRead`). The raw value (``nnx.split``,
``jax.tree.leaves(nnx.state(model))``) is the ``(replicas, chunk)`` array of
slices, a shape of its own. Checkpoints hold the whole arrays
(:mod:`fleet.checkpoint._state`), so they restore onto any replica count and
any stage.

A Linen model holds no parameters: its wrapped ``init`` splits the ``params``
collection (:func:`split_params`: each leaf a
:class:`~fleet.sections._sharding.Shard`, which a ``TrainState`` carries into
the step, as it carries the optimizer state's), its ``apply`` gathers them, and
the distributed optax transformation updates the slices and returns its updates
as ``Shard`` s, so ``optax.apply_updates`` keeps them split.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from fleet._errors import FleetError, FleetUnsupportedError
from fleet.comm import _synced
from fleet.comm._shard_comm import to_logical, to_shards
from fleet.runtime._leaves import module_variables
from fleet.sections._sharding import Config, Shard, config, is_shard, mark_sharded


def shard_parameters(obj: Any, wrt: Any, cfg: Config) -> None:
    """Stage 3: splits ``obj``'s ``wrt`` parameters over the replicas, in place
    (see the module docstring). Each must be a wrapped model's parameter."""
    allowed = nnx.filterlib.to_predicate(wrt)
    variables = {k: v for k, v in module_variables(obj).items()
                 if allowed(tuple(k.split(".")), v)}
    plain = [k for k, v in variables.items() if not isinstance(v, _synced.SyncedRead)]
    if plain:
        raise FleetUnsupportedError(
            f"sharding_configs.stage = 3 splits the parameters of a model wrapped by "
            f"fleet.distributed_model, and {type(obj).__name__}'s parameter {plain[0]!r} is "
            "not one: wrap the model (model = fleet.distributed_model(model)) before building "
            "its optimizer, or use stage 2")
    for var in variables.values():
        spec = var.get_metadata("fleet_sync")
        if spec.layout is not None:
            continue
        layout = cfg.layout(var.get_raw_value().shape)
        var.set_raw_value(to_shards(var.get_raw_value(), layout))
        var.set_metadata("fleet_sync", dataclasses.replace(spec, layout=layout))
        mark_sharded(var, layout)


def whole_copy(module: Any) -> Any:
    """A copy of ``module`` whose stage-3 parameters hold their whole values as
    plain (unsplit) parameters: what an export traces (``Model.save(path,
    training=False)``). ``module`` itself, when none is split."""
    if all(_synced.layout_of(v) is None for v in module_variables(module).values()):
        return module
    copy = nnx.clone(module)
    for var in module_variables(copy).values():
        layout = _synced.layout_of(var)
        if layout is not None:
            make_whole(var, to_logical(var.get_raw_value(), layout))
    return copy


def make_whole(var: Any, value: Any) -> None:
    """A stage-3 parameter of a copy (an export's, verify's reference) made a
    whole parameter holding ``value``: read and synced as at the other stages."""
    var.set_raw_value(value)
    var.set_metadata("fleet_sync", dataclasses.replace(var.get_metadata("fleet_sync"),
                                                       layout=None))
    var.set_metadata("fleet_shard", None)


def split_params(variables: Any) -> Any:
    """Stage 3, a Linen model's ``init``: each leaf of the ``params`` collection as a
    :class:`~fleet.sections._sharding.Shard` (its replicas' slices), which the
    ``TrainState`` holds; the distributed optimizer's state is split alike."""
    cfg = config()

    def split(x: Any) -> Shard:
        layout = cfg.layout(x.shape)
        return Shard(to_shards(x, layout), layout)

    return {**variables, "params": jax.tree.map(split, variables["params"])}


def whole_params(variables: Any) -> Any:
    """``variables`` with each :class:`~fleet.sections._sharding.Shard` whole (a Linen
    model's ``apply`` outside a step)."""
    return jax.tree.map(lambda x: to_logical(x.value, x.layout) if is_shard(x) else x,
                        variables, is_leaf=is_shard)


def split_gradients(trace: Any, grads: Any) -> bool:
    """Whether ``grads`` (in a step's ``trace``) are stage 3's: the placeholders of
    split parameters' gradients (an optimizer with no state shaped like the
    parameters, plain SGD, still updates them as slices)."""
    if trace is None or trace.shard.config is None or trace.shard.config.stage != 3:
        return False
    return any(id(g) in trace.shard.layouts for g in jax.tree.leaves(grads))


def active(strategy: Any) -> bool:
    """Whether ``strategy`` shards the parameters (stage 3)."""
    return bool(strategy.sharding) and strategy.sharding_configs.stage == 3


#: What stage 3 does not compose with yet, and what to write instead.
_REFUSED = {
    "no_sync": (
        "model.no_sync() keeps each replica's local gradients of the whole parameters "
        "between steps, and stage 3 holds only the replicas' slices of them; make the "
        "batch larger instead, or use sharding_configs.stage = 2 with no_sync"),
    "gradient_merge": (
        "strategy.gradient_merge accumulates each replica's local gradients of the whole "
        "parameters over k_steps calls, and stage 3 holds only the replicas' slices of "
        "them; use sharding_configs.stage = 2 with gradient_merge, or optax.MultiSteps "
        "inside the optimizer"),
    "parameters fleet did not split": (
        "a Linen model's parameters are split by the wrapped model's init "
        "(variables = fleet.distributed_model(module).init(rng, x)), and the optimizer got "
        "whole ones (from module.init, or raw parameters of the functional style). "
        "Initialise them with the wrapped model, or use sharding_configs.stage = 2"),
}


def refuse(feature: str) -> FleetError:
    """The error for ``feature`` (a key of ``_REFUSED``) under stage 3."""
    return FleetUnsupportedError(f"sharding_configs.stage = 3 with {feature}: {_REFUSED[feature]}")
