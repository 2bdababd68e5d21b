"""``fleet.DataParallel`` / ``fleet.distributed_model``: the model, replicated.

For an NNX module, ``DataParallel(model)`` is a view of the same module: an
instance of a subclass of both ``DataParallel`` and the model's own class that
shares the model's attributes and variables. So ``isinstance(dp, MyNet)`` holds,
every method of the model works on it, its state has exactly the model's paths
(no wrapper prefix), and an optimizer built on the model before wrapping and one
built on the wrapper after are the same thing.

For a Linen module, which holds no state, ``DataParallel`` keeps the module and
replicates the variables its ``init`` returns.

At wrapping, every replica gets identical values: each array is taken from the
first device of process 0 and placed, replicated, on the mesh, after checking
that every process has the same shapes and dtypes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import linen, nnx
from flax.nnx import bridge

from fleet import _compat
from fleet._errors import FleetConfigError, FleetError, FleetTypeError, FleetUnsupportedError
from fleet.comm import _sync, _synced
from fleet.comm._buckets import BucketConfig, strategy_buckets
from fleet.comm._reduce import reduce_gradients
from fleet.runtime._leaves import dotted, module_variables, state_dict
from fleet.runtime._replicate import load_state_dict, replicate, replicate_in_place
from fleet.runtime._world import current_strategy, world
from fleet.sections import _amp, _batch_norm, _recompute, _sharding, _stage3


def _bucket_config(comm_buffer_size: Any, last_comm_buffer_size: Any) -> BucketConfig:
    """The buckets: given sizes, else the strategy's (one default: 32 MB and 1 MB)."""
    config = strategy_buckets()
    given = {"comm_buffer_size": comm_buffer_size, "last_comm_buffer_size": last_comm_buffer_size}
    for name, size in given.items():
        if size is None:
            continue
        if (isinstance(size, bool) or not isinstance(size, (int, float)) or not np.isfinite(size)
                or size <= 0):
            raise FleetConfigError(
                f"{name} must be a positive, finite number of MB, got {size!r}"
            )
        config = dataclasses.replace(config, **{name: float(size)})
    return config


_SUBCLASSES: dict[type, type] = {}


def copies_made_before_wrapping(objs: tuple) -> list[str]:
    """The classes of which the NNX objects ``objs`` hold both a wrapped model
    (``DataParallel[C]``) and a plain ``C``: a copy of the model made before it
    was wrapped (an EMA, a teacher). Their pytree structures differ, so a
    ``jax.tree.map`` over both fails inside the step, not on one device."""
    seen = {type(node) for _, node in nnx.iter_graph(objs)}
    return sorted(c.__name__ for c in seen & set(_SUBCLASSES) if _SUBCLASSES[c] in seen)


def _install_hooks(module: nnx.Module, buckets: BucketConfig) -> None:
    """Makes every parameter read through fleet's gradient sync (see fleet.comm._sync)."""
    for key, var in module_variables(module).items():
        if isinstance(var, nnx.Param):
            _synced.make_synced(var, _synced.SyncSpec(key, buckets))


class DataParallel(nnx.Module):
    """Runs a model data-parallel (Paddle's ``paddle.DataParallel``).

    Wrapping is what makes gradients synchronised, as with Paddle and torch DDP:
    the gradient any code in a :func:`fleet.distributed_step` computes for this
    model's parameters is averaged over the replicas in the backward pass (one
    all-reduce per bucket), so a plain ``nnx.Optimizer``, a plain optax
    transformation or a hand-written update all see the global-batch gradient.

    Args:
        layers: a Flax NNX module (its variables are replicated in place) or a
            Flax Linen module (use ``init`` / ``apply``).
        strategy: deprecated in Paddle; ignored.
        comm_buffer_size: gradient bucket size in MB (default: the strategy's
            ``fuse_grad_size_in_MB``, 32).
        last_comm_buffer_size: size cap in MB of the bucket holding the first
            layers (default: the strategy's ``last_comm_group_size_MB``, 1).
        find_unused_parameters: accepted for Paddle scripts and not used: JAX
            gives a parameter that does not reach the loss a zero gradient.

    Example:
        >>> model = fleet.DataParallel(MyNet(nnx.Rngs(0)))  # doctest: +SKIP
        >>> isinstance(model, MyNet)
        True
    """

    def __new__(cls, layers: Any = None, *args: Any, **kwargs: Any):
        if cls is not DataParallel:  # a subclass being rebuilt by nnx
            return object.__new__(cls)
        if isinstance(layers, DataParallel):
            raise FleetTypeError(
                "this model is already a fleet.DataParallel; wrap the original model once"
            )
        if isinstance(layers, nnx.Module):
            _refuse_bridged(layers)
            base = type(layers)
            sub = _SUBCLASSES.get(base)
            if sub is None:
                sub = type(f"DataParallel[{base.__name__}]", (DataParallel, base), {})
                _SUBCLASSES[base] = sub
            return object.__new__(sub)
        if isinstance(layers, linen.Module):
            return object.__new__(LinenDataParallel)
        raise FleetTypeError(
            f"DataParallel takes a Flax NNX or Linen module, got {type(layers).__name__}"
        )

    def __init__(
        self,
        layers: Any,
        strategy: Any = None,
        comm_buffer_size: float | None = None,
        last_comm_buffer_size: float | None = None,
        find_unused_parameters: bool = False,
    ):
        del strategy
        if not isinstance(find_unused_parameters, bool):
            raise FleetTypeError(
                f"find_unused_parameters must be a bool, got {find_unused_parameters!r}"
            )
        self._fleet_buckets = _bucket_config(comm_buffer_size, last_comm_buffer_size)
        self._fleet_amp = _amp.policy_of(current_strategy())
        self._adopt(layers)

    def _adopt(self, layers: nnx.Module) -> None:
        _compat.share_fields(self, layers)
        replicate_in_place(layers)
        _install_hooks(self, self._fleet_buckets)
        strategy = current_strategy()
        if self._fleet_amp is not None:
            _amp.apply(self, self._fleet_amp, type(layers).__name__)
        if strategy.recompute:
            cfg = strategy.recompute_configs
            _recompute.install(self, cfg.checkpoints, cfg.remat_policy)
        _batch_norm.install(self, strategy.sync_batch_norm)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``__call__``; inside a step its parameters are synced
        in buckets for the backward pass."""
        call = super().__call__  # the wrapped model's class comes next in the MRO
        trace = _sync.current()
        if trace is None:
            out = call(*args, **kwargs)
        else:
            params = {k: v for k, v in module_variables(self).items() if isinstance(v, nnx.Param)}
            with _synced.bucketed_call(params, self._fleet_buckets):
                out = call(*args, **kwargs)
        amp = self._fleet_amp
        if amp is None:
            return out
        out = _amp.outputs_to_float32(out)
        if amp.loss_scaling and trace is not None and any(
                _sync.is_differentiated(x) for x in jax.tree.leaves(out)):
            if trace.tx.loss_scale is None:
                raise FleetError(
                    "strategy.amp with float16 scales the loss, and the scale lives in the "
                    "distributed optimizer: pass fleet.distributed_optimizer(nnx.Optimizer("
                    "model, tx, wrt=nnx.Param)) to this step and update with it"
                )
            out = _amp.scale_cotangent(out, trace.tx.loss_scale)
        return out

    # -- Paddle's methods --------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps called inside accumulate gradients locally, with no communication.

        As in Paddle and torch DDP, the gradients are *added*: the first step
        after the block averages (over replicas) the sum of the accumulated local
        gradients and its own. For the update of one step on the union of the
        ``k + 1`` batches, divide the loss by ``k + 1``. Inside the block, update
        with a :func:`fleet.distributed_optimizer`, which does not step there.
        """
        with _sync.no_sync():
            yield

    def scale_loss(self, loss: Any) -> Any:
        """Paddle 2.0 API. fleet averages gradients, so the loss needs no scaling:
        returns ``loss`` unchanged."""
        return loss

    def apply_collective_grads(self, grads: Any) -> Any:
        """Paddle 2.0 API: returns ``grads`` averaged over the replicas. Gradients
        of this model's parameters are averaged already by the backward pass, so
        they come back unchanged; per-replica (varying) ones are averaged."""
        return reduce_gradients(grads, self._fleet_buckets)

    def state_dict(
        self, destination: dict | None = None, include_sublayers: bool = True,
        structured_name_prefix: str = "",
    ) -> dict[str, np.ndarray]:
        """Parameters and other variables, keyed as in the unwrapped model
        (``"linear1.kernel"``), as host numpy arrays (PRNG keys as their key data).

        Args (Paddle's): ``destination``: a dict to fill and return;
        ``include_sublayers=False`` keeps only this layer's own variables (no
        dot in their name); ``structured_name_prefix`` is put before every key.
        """
        out = {} if destination is None else destination
        for key, value in state_dict(self).items():
            if include_sublayers or "." not in key:
                out[structured_name_prefix + key] = value
        return out

    def set_state_dict(self, state_dict: dict[str, Any], use_structured_name: bool = True) -> None:
        """Loads values saved by ``state_dict`` (of this or the unwrapped model).

        Every key must be known and every shape and dtype equal; otherwise nothing
        changes and the error lists the differences. With
        ``use_structured_name=False`` (Paddle's other key style) the keys are
        matched in order against the model's variables instead of by name.
        """
        if not use_structured_name:
            current = module_variables(self)
            if len(state_dict) != len(current):
                raise FleetError(
                    f"state_dict has {len(state_dict)} entries, the model {len(current)} "
                    "variables; with use_structured_name=False they are matched in order"
                )
            state_dict = dict(zip(current, state_dict.values()))
        load_state_dict(self, state_dict, "model",
                        "Load a state_dict saved from the same model (same keys and shapes)",
                        intro="state_dict does not fit the model")


class LinenDataParallel(DataParallel):
    """``DataParallel`` over a Linen module: ``init`` replicates, ``apply`` runs it
    and, inside a step, syncs the gradients of its ``params`` in buckets."""

    def __init__(
        self,
        layers: linen.Module,
        strategy: Any = None,
        comm_buffer_size: float | None = None,
        last_comm_buffer_size: float | None = None,
        find_unused_parameters: bool = False,
    ):
        self.module = layers
        strategy = current_strategy()
        if strategy.amp or strategy.recompute:
            raise FleetUnsupportedError(
                "strategy.amp and strategy.recompute run on Flax NNX models; for a Linen "
                "module set its layers' dtype=jnp.bfloat16 and use nn.remat yourself, or "
                "port the model to NNX")
        self._fleet_sync_bn = strategy.sync_batch_norm
        super().__init__(
            layers, strategy, comm_buffer_size, last_comm_buffer_size, find_unused_parameters
        )

    def _adopt(self, layers: Any) -> None:
        pass  # a Linen module holds no variables

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init``, with the variables replicated on the mesh. Under
        ``jax.jit(model.init)`` (as Flax's examples write it) the compiled program
        places them so itself: every process computes them from the same key."""
        variables = self.module.init(*args, **kwargs)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(variables)):
            variables = jax.lax.with_sharding_constraint(variables, world().replicated)
        else:
            variables = replicate(variables)
        if _stage3.active(current_strategy()) and "params" in variables:
            return _stage3.split_params(variables)  # (a TrainState holds the slices)
        return variables

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.apply``; inside a step, the ``params`` collection's gradients
        are averaged over the replicas in the backward pass, and each
        ``nn.BatchNorm`` in training mode runs as ``strategy.sync_batch_norm`` or
        its ``axis_name`` says (``fleet.sections._batch_norm.linen_interceptor``)."""
        if _sync.current() is None:  # (stage 3's slices whole: fleet.sections._stage3)
            if _stage3.active(current_strategy()):
                variables = _stage3.whole_params(variables)
        else:
            flat, treedef = jax.tree_util.tree_flatten_with_path(variables,
                                                                 is_leaf=_sharding.is_shard)
            keys = [dotted(p) for p, _ in flat]
            leaves = [x.value if _sharding.is_shard(x) else x for _, x in flat]
            layouts = [x.layout if _sharding.is_shard(x) else None for _, x in flat]
            todo = [i for i, k in enumerate(keys) if k == "params" or k.startswith("params.")]
            synced = _sync.sync_leaves([keys[i] for i in todo], [leaves[i] for i in todo],
                                       self._fleet_buckets, [layouts[i] for i in todo])
            for i, y in zip(todo, synced):
                leaves[i] = y
            variables = jax.tree_util.tree_unflatten(treedef, leaves)
        with linen.intercept_methods(_batch_norm.linen_interceptor(self._fleet_sync_bn)):
            return self.module.apply(variables, *args, **kwargs)

    def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        return self.apply(variables, *args, **kwargs)

    def state_dict(self, variables: Any = None) -> dict[str, np.ndarray]:  # type: ignore[override]
        """Flat ``{"params.Dense_0.kernel": array}`` of ``variables`` (Linen keeps
        variables outside the module)."""
        if variables is None:
            raise FleetError("a Linen model holds no variables: call state_dict(variables)")
        flat = jax.tree_util.tree_flatten_with_path(variables)[0]
        return {dotted(path): np.asarray(v) for path, v in flat}

    def set_state_dict(self, state_dict: dict[str, Any], variables: Any = None) -> Any:  # type: ignore[override]
        """Returns ``variables`` with the values of ``state_dict``, replicated."""
        if variables is None:
            raise FleetError("a Linen model holds no variables: pass the current variables")
        flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
        keys = [dotted(path) for path, _ in flat]
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if missing or unexpected:
            raise FleetError(f"state_dict does not fit: missing {missing}, unexpected {unexpected}")
        return replicate(jax.tree_util.tree_unflatten(treedef, [state_dict[k] for k in keys]))


def _refuse_bridged(layers: nnx.Module) -> None:
    """Refuses an ``nnx.bridge.ToNNX`` module inside: the bridge knows no ``SyncedParam``."""
    for path, node in nnx.iter_graph(layers):
        if isinstance(node, bridge.ToNNX):
            raise FleetTypeError(
                "the model holds a Linen module converted by flax.nnx.bridge.ToNNX"
                f"{f' at {dotted(path)}' if path else ''} ({type(node.to_nnx__module).__name__}): "
                "fleet cannot wrap such a module yet. Wrap the Linen module itself, model = "
                "fleet.distributed_model(linen_module), and train it with its apply (a "
                "TrainState, fleet.distributed_step), or write the layer as an NNX module")


def distributed_model(model: Any) -> DataParallel:
    """Wraps ``model`` in :class:`DataParallel` with the buckets of the strategy
    given to ``fleet.init`` (``fuse_grad_size_in_MB``, ``last_comm_group_size_MB``,
    ``fuse_all_reduce_ops``).

    Example:
        >>> model = fleet.distributed_model(MyNet(nnx.Rngs(0)))  # doctest: +SKIP
    """
    world()  # fleet.init first
    return DataParallel(model)
