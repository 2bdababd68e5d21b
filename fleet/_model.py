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
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from fleet import _context
from fleet._context import BucketConfig
from fleet._errors import FleetConfigError, FleetError, FleetTypeError
from fleet._reduce import reduce_gradients
from fleet._world import world


def _first_replica_value(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def _dotted(path: tuple) -> str:
    """``"layers.0.kernel"`` for a key path (dict keys, indices, attributes)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _check_same_across_processes(paths: list[str], leaves: list[np.ndarray]) -> None:
    from jax.experimental import multihost_utils

    desc = [zlib.crc32(f"{p}:{x.shape}:{x.dtype}".encode()) for p, x in zip(paths, leaves)]
    counts = multihost_utils.process_allgather(np.array([len(desc)], np.int64))
    if len(set(counts.ravel().tolist())) != 1:
        raise FleetError(
            f"processes hold models of different sizes (parameter counts per process: "
            f"{counts.ravel().tolist()}); every process must build the same model"
        )
    table = multihost_utils.process_allgather(np.array(desc, np.int64))
    for i, path in enumerate(paths):
        column = table.reshape(-1, len(desc))[:, i]
        if (column != column[0]).any():
            bad = int(np.nonzero(column != column[0])[0][0])
            raise FleetError(
                f"parameter {path!r} differs in shape or dtype between process 0 and "
                f"process {bad} (here: shape {leaves[i].shape}, dtype {leaves[i].dtype}); "
                "every process must build the same model"
            )


def replicate(tree: Any) -> Any:
    """Places every array leaf of ``tree`` replicated on the mesh, equal everywhere.

    Values come from the first device of process 0 (broadcast to the others).
    PRNG key arrays travel as their key data and are wrapped again.
    """
    w = world()
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [_dotted(p) for p, _ in paths_leaves]
    impls = [jax.random.key_impl(x) if _is_key(x) else None for _, x in paths_leaves]
    host = [
        _first_replica_value(jax.random.key_data(x) if impl else x)
        for (_, x), impl in zip(paths_leaves, impls)
    ]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        _check_same_across_processes(paths, host)
        host = list(multihost_utils.broadcast_one_to_all(host))
    placed = []
    for h, impl in zip(host, impls):
        x = jax.make_array_from_callback(h.shape, w.replicated, lambda idx, h=h: h[idx])
        placed.append(jax.random.wrap_key_data(x, impl=impl) if impl else x)
    return jax.tree_util.tree_unflatten(treedef, placed)


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def _to_host(x: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _like(current: Any, host: np.ndarray) -> Any:
    """``host`` as a value for a variable holding ``current`` (wraps PRNG key data)."""
    return jax.random.wrap_key_data(host, impl=jax.random.key_impl(current)) if _is_key(current) else host


def module_variables(module: nnx.Module) -> dict[str, nnx.Variable]:
    """The module's variables by dotted path (``"linear1.kernel"``)."""
    flat = nnx.to_flat_state(nnx.state(module))
    return {".".join(map(str, path)): var for path, var in flat}


def set_replicated(variables: dict[str, nnx.Variable], values: dict[str, Any]) -> None:
    placed = replicate(values)
    for key, var in variables.items():
        var.set_value(placed[key])


def replicate_in_place(obj: nnx.Pytree) -> None:
    """Makes every variable of ``obj`` replicated on the mesh, equal everywhere."""
    variables = module_variables(obj)
    set_replicated(variables, {k: v.get_value() for k, v in variables.items()})


_SUBCLASSES: dict[type, type] = {}


class DataParallel(nnx.Module):
    """Runs a model data-parallel (Paddle's ``paddle.DataParallel``).

    Args:
        layers: a Flax NNX module (its variables are replicated in place) or a
            Flax Linen module (use ``init`` / ``apply``).
        strategy: deprecated in Paddle; ignored.
        comm_buffer_size: gradient bucket size in MB.
        last_comm_buffer_size: size cap in MB of the bucket holding the first layers.
        find_unused_parameters: accepted for Paddle scripts; JAX gives parameters
            that do not reach the loss a zero gradient, so nothing more is needed.

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
        comm_buffer_size: float = 25,
        last_comm_buffer_size: float = 1,
        find_unused_parameters: bool = False,
    ):
        del strategy
        for name, size in (("comm_buffer_size", comm_buffer_size),
                           ("last_comm_buffer_size", last_comm_buffer_size)):
            if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
                raise FleetConfigError(f"{name} must be a positive number of MB, got {size!r}")
        self._adopt(layers)
        self._fleet_buckets = BucketConfig(float(comm_buffer_size), float(last_comm_buffer_size))
        self._fleet_find_unused_parameters = bool(find_unused_parameters)

    def _adopt(self, layers: nnx.Module) -> None:
        for name, value in vars(layers).items():
            if name != "_pytree__state":
                object.__setattr__(self, name, value)
        replicate_in_place(layers)

    # -- Paddle's methods --------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps called inside accumulate gradients locally, with no communication.

        The optimizer does not step inside; the first step after the block
        averages the accumulated gradients with its own over all replicas and
        steps once: the same update as one step on the union of the batches.
        """
        with _context.no_sync():
            yield

    def scale_loss(self, loss: Any) -> Any:
        """Paddle 2.0 API. fleet averages gradients, so the loss needs no scaling:
        returns ``loss`` unchanged."""
        return loss

    def apply_collective_grads(self, grads: Any) -> Any:
        """Paddle 2.0 API: averages ``grads`` over the replicas and returns them
        (JAX gradients are values, not fields of the parameters). The distributed
        optimizer does not reduce them again."""
        return reduce_gradients(grads, self._fleet_buckets)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and other variables, keyed as in the unwrapped model
        (``"linear1.kernel"``), as host numpy arrays (PRNG keys as their key data)."""
        return {k: _to_host(v.get_value()) for k, v in module_variables(self).items()}

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads values saved by ``state_dict`` (of this or the unwrapped model).

        Every key must be known and every shape and dtype equal; otherwise nothing
        changes and the error lists the differences.
        """
        current = module_variables(self)
        problems = [f"missing {k!r}" for k in current if k not in state_dict]
        problems += [f"unexpected {k!r}" for k in state_dict if k not in current]
        for key, value in state_dict.items():
            if key in current:
                old, new = _to_host(current[key].get_value()), np.asarray(value)
                if old.shape != new.shape or old.dtype != new.dtype:
                    problems.append(
                        f"{key!r}: model has {old.shape} {old.dtype}, given {new.shape} {new.dtype}"
                    )
        if problems:
            raise FleetError("state_dict does not fit the model: " + "; ".join(problems))
        set_replicated(current, {
            k: _like(current[k].get_value(), np.asarray(state_dict[k])) for k in current
        })


class LinenDataParallel(DataParallel):
    """``DataParallel`` over a Linen module: ``init`` replicates, ``apply`` runs it."""

    def __init__(
        self,
        layers: linen.Module,
        strategy: Any = None,
        comm_buffer_size: float = 25,
        last_comm_buffer_size: float = 1,
        find_unused_parameters: bool = False,
    ):
        self.module = layers
        super().__init__(
            layers, strategy, comm_buffer_size, last_comm_buffer_size, find_unused_parameters
        )

    def _adopt(self, layers: Any) -> None:
        pass  # a Linen module holds no variables

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init``, with the variables replicated on the mesh."""
        return replicate(self.module.init(*args, **kwargs))

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        return self.module.apply(variables, *args, **kwargs)

    def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        return self.module.apply(variables, *args, **kwargs)

    def state_dict(self, variables: Any = None) -> dict[str, np.ndarray]:  # type: ignore[override]
        """Flat ``{"params.Dense_0.kernel": array}`` of ``variables`` (Linen keeps
        variables outside the module)."""
        if variables is None:
            raise FleetError("a Linen model holds no variables: call state_dict(variables)")
        flat = jax.tree_util.tree_flatten_with_path(variables)[0]
        return {_dotted(path): np.asarray(v) for path, v in flat}

    def set_state_dict(self, state_dict: dict[str, Any], variables: Any = None) -> Any:  # type: ignore[override]
        """Returns ``variables`` with the values of ``state_dict``, replicated."""
        if variables is None:
            raise FleetError("a Linen model holds no variables: pass the current variables")
        flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
        keys = [_dotted(path) for path, _ in flat]
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if missing or unexpected:
            raise FleetError(f"state_dict does not fit: missing {missing}, unexpected {unexpected}")
        return replicate(jax.tree_util.tree_unflatten(treedef, [state_dict[k] for k in keys]))


def distributed_model(model: Any) -> DataParallel:
    """Wraps ``model`` in :class:`DataParallel` with the buckets of the strategy
    given to ``fleet.init`` (``fuse_grad_size_in_MB``, ``last_comm_group_size_MB``,
    ``find_unused_parameters``)."""
    strategy = world().strategy
    dp = DataParallel(
        model,
        comm_buffer_size=strategy.fuse_grad_size_in_MB,
        last_comm_buffer_size=strategy.last_comm_group_size_MB,
        find_unused_parameters=strategy.find_unused_parameters,
    )
    dp._fleet_buckets = BucketConfig(
        strategy.fuse_grad_size_in_MB, strategy.last_comm_group_size_MB,
        strategy.fuse_all_reduce_ops,
    )
    return dp
