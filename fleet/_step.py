"""``fleet.distributed_step``: the decorator that replaces ``jax.jit`` on a step.

The step runs once per replica (``jax.shard_map`` over the ``data`` axis, the
engine under today's ``jax.pmap``), inside one ``jax.jit``.

How arguments are told apart (``batch_argnums=None``):

* **state**, replicated on every device: NNX objects (modules, optimizers,
  ``fleet.DataParallel``) and dataclass pytrees such as Flax's ``TrainState``;
* **batch**, split along the leading axis: arrays (numpy or jax) and tuples,
  lists and dicts of them. In a multi-process job a numpy batch is this
  process's part (its rows of the global batch, in process order); a
  ``jax.Array`` is taken as the global batch;
* **replicated values**: Python and numpy scalars (traced: no recompiles);
* **static**: anything else hashable (strings, ``None``, functions).

Pass ``batch_argnums=(2, 3)`` to say which positional arguments are the batch;
then every other array argument is replicated state (raw parameter pytrees).

What comes back:

* NNX objects are updated in place;
* an output with the structure of a state argument (a new ``TrainState``, new
  parameters) is state, replicated;
* a floating-point scalar is the mean over the replicas: the global-batch value
  a single-device step prints; an integer scalar (a count) is the sum;
* an array with a leading axis is per example: gathered along that axis in
  global batch order.

Gradients are not reduced by the transpose of ``shard_map``: the body runs with
``check_vma=False``, so the bucketed ``psum`` of the distributed optimizer is the
only reduction. The step compiles once per input shape (and once more for the
first steps under ``no_sync``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from fleet import _context
from fleet._context import BucketConfig
from fleet._errors import FleetConfigError, FleetError, FleetTypeError
from fleet._model import DataParallel
from fleet._reduce import allreduce_mean
from fleet._world import DATA_AXIS, World, world
from fleet.launch._heartbeat import heartbeat

_NNX, _TREE, _BATCH, _REPL, _STATIC = "nnx", "state", "batch", "replicated", "static"


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _is_batch_like(x: Any) -> bool:
    if _is_array(x):
        return np.ndim(x) > 0
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return len(x) > 0 and all(_is_batch_like(v) for v in x)
    if isinstance(x, dict):
        return len(x) > 0 and all(_is_batch_like(v) for v in x.values())
    return False


def _holds_arrays(x: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(_is_array(v) or isinstance(v, (int, float, np.generic))
                                for v in leaves)


def _kind(x: Any, is_batch: bool | None) -> str:
    if isinstance(x, nnx.Pytree):
        return _NNX
    if isinstance(x, (bool, int, float, complex, np.generic)) or (
        _is_array(x) and np.ndim(x) == 0
    ):
        return _REPL
    if is_batch or (is_batch is None and _is_batch_like(x)):
        return _BATCH
    return _TREE if _holds_arrays(x) else _STATIC


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """Everything static about one call: the jit cache key.

    jit hashes it on every call, and an NNX graphdef is slow to hash, so the hash
    is computed once and a step reuses the plan while nothing static changes.
    """

    kinds: tuple[str, ...]
    kw_names: tuple[str, ...]
    statics: tuple[Any, ...]
    graphdef: Any
    state_treedef: Any
    no_sync: bool
    has_accum: bool
    buckets: BucketConfig
    mesh: Any

    def _key(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(self._key()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (
            isinstance(other, _Plan) and self._hash == other._hash and self._key() == other._key()
        )


def _plain_array_variable(v: nnx.Variable) -> bool:
    """Whether ``v`` holds one jax.Array and has no get/set hooks: then the step reads
    and writes its raw value directly (Flax's private fields; any other Flax layout
    falls back to ``get_value`` / ``set_value``)."""
    metadata = getattr(v, "_var_metadata", None)
    return (
        isinstance(getattr(v, "_raw_value", None), jax.Array)
        and isinstance(metadata, dict)
        and not metadata.get("on_get_value")
        and not metadata.get("on_set_value")
    )


class _GraphCache:
    """The NNX objects' graph, split once and reused while their structure holds."""

    def __init__(self, objs: tuple):
        self.objs = objs
        self.tree_vars, self.treedef = self._tree_view(objs)
        self.graphdef, state = nnx.split(objs)
        self.variables = jax.tree_util.tree_leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.state_treedef = jax.tree_util.tree_structure(state)
        self.fast = all(map(_plain_array_variable, self.variables)) and (
            self.state_treedef.num_leaves == len(self.variables)
        )

    @staticmethod
    def _tree_view(objs: tuple) -> tuple[list, Any]:
        return jax.tree_util.tree_flatten(objs, is_leaf=lambda v: isinstance(v, nnx.Variable))

    def holds(self, objs: tuple) -> bool:
        if len(objs) != len(self.objs) or any(a is not b for a, b in zip(objs, self.objs)):
            return False
        tree_vars, treedef = self._tree_view(objs)
        return treedef == self.treedef and all(a is b for a, b in zip(tree_vars, self.tree_vars))

    def read(self) -> list:
        if self.fast:
            return [v._raw_value for v in self.variables]
        return [v.get_value() for v in self.variables]

    def write(self, values: Sequence) -> None:
        if self.fast:  # outside any trace: skip Variable.__setattr__'s trace checks
            for v, x in zip(self.variables, values):
                object.__setattr__(v, "_raw_value", x)
        else:
            for v, x in zip(self.variables, values):
                v.set_value(x)


def _is_buffer(v: nnx.Variable) -> bool:
    """Model state that is neither a parameter nor optimizer state (batch-norm
    statistics): each replica updates it from its own rows."""
    from flax.nnx.training.optimizer import OptState

    return not isinstance(v, (nnx.Param, OptState))


def _average_buffers(new: Any, old: list, new_leaves: list, buckets: BucketConfig) -> list:
    """Averages, over the replicas, the floating-point buffers the step changed.

    Parameters and optimizer state come out equal on every replica (the gradients
    were averaged); buffers such as batch-norm running statistics were updated from
    each replica's own rows and would differ while marked replicated. The average
    of the replicas' running means is the running mean of the global batch, as on
    one device (running variances average the per-replica variances). A step under
    ``no_sync`` leaves them local: the next synchronised step averages them.
    """
    variables = jax.tree_util.tree_leaves(new, is_leaf=lambda v: isinstance(v, nnx.Variable))
    changed = [
        i for i, (v, x) in enumerate(zip(variables, new_leaves))
        if x is not old[i] and _is_buffer(v) and jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not changed:
        return new_leaves
    averaged = allreduce_mean([new_leaves[i] for i in changed], buckets)
    new_leaves = list(new_leaves)
    for i, x in zip(changed, averaged):
        new_leaves[i] = x
    return new_leaves


def _signature(x: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(x)
    return treedef, tuple((jnp.shape(v), jnp.result_type(v)) for v in leaves)


class DistributedStep:
    """A step function run data-parallel; see :func:`distributed_step`."""

    def __init__(self, fn: Callable, batch_argnums: Sequence[int] | None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self._jitted: dict[Any, Callable] = {}
        self._graph: _GraphCache | None = None
        self._last_plan: _Plan | None = None
        self._accum: list | None = None  # gradients accumulated under no_sync
        self._accum_count = 0
        self.trace_count = 0  # how often the body was traced for real (tests read it)

    # -- the call, on the host ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        heartbeat()  # tells fleetrun's watchdog this worker reached the step
        plan, call_args = self._prepare(args, kwargs)
        compiled = self._compiled(plan)
        try:
            new_state, out, new_accum = compiled(*call_args)
        except ValueError as e:
            if "sharding" not in str(e).lower() and "device" not in str(e).lower():
                raise
            # Arrays committed elsewhere (a new TrainState's step counter, arrays made
            # on one device): place them on the mesh and go on.
            w = world()
            state, trees, batch, *rest = call_args
            state, trees = jax.device_put((state, trees), w.replicated)
            batch = jax.device_put(batch, w.batch)
            new_state, out, new_accum = compiled(state, trees, batch, *rest)
        self._graph.write(new_state)
        if plan.no_sync:
            self._accum = new_accum
            self._accum_count += new_accum is not None
        elif plan.has_accum:
            self._accum, self._accum_count = None, 0
        heartbeat()
        return out

    def make_jaxpr(self, *args: Any, **kwargs: Any) -> Any:
        """The jaxpr of the program a call with these arguments runs (nothing runs,
        nothing is updated). Its ``shard_map`` body shows the gradient buckets: one
        ``psum`` each."""
        plan, call_args = self._prepare(args, kwargs)
        return jax.make_jaxpr(self._global, static_argnums=0)(plan, *call_args)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[_Plan, tuple]:
        w = world()
        names = tuple(sorted(kwargs))
        values = list(args) + [kwargs[k] for k in names]
        batch_argnums = self._batch_argnums
        kinds = tuple(
            _kind(v, None if batch_argnums is None else i in batch_argnums)
            for i, v in enumerate(values)
        )
        objs = tuple(v for v, k in zip(values, kinds) if k == _NNX)
        if self._graph is None or not self._graph.holds(objs):
            self._graph = _GraphCache(objs)
        plan = self._plan(
            kinds=kinds,
            kw_names=names,
            statics=tuple(v for v, k in zip(values, kinds) if k == _STATIC),
            graphdef=self._graph.graphdef,
            state_treedef=self._graph.state_treedef,
            no_sync=_context.no_sync_active(),
            has_accum=self._accum is not None,
            buckets=self._buckets(values, w),
            mesh=w.mesh,
        )
        call_args = (
            self._graph.read(),
            [v for v, k in zip(values, kinds) if k == _TREE],
            [self._check_batch(i, v, w) for i, (v, k) in enumerate(zip(values, kinds))
             if k == _BATCH],
            [v for v, k in zip(values, kinds) if k == _REPL],
            self._accum,
            np.float32(self._accum_count),
        )
        return plan, call_args

    def _plan(self, **fields: Any) -> _Plan:
        last = self._last_plan
        if last is not None and all(
            getattr(last, k) is v or getattr(last, k) == v for k, v in fields.items()
        ):
            return last
        for value in fields["statics"]:
            try:
                hash(value)
            except TypeError:
                raise FleetTypeError(
                    f"an argument of type {type(value).__name__} is passed to the step as a "
                    "static value (it holds no arrays), but it is not hashable; pass arrays, "
                    "NNX objects or scalars, or make it hashable (a tuple instead of a list)"
                ) from None
        self._last_plan = _Plan(**fields)
        return self._last_plan

    def _buckets(self, values: list, w: World) -> BucketConfig:
        for v in values:
            if isinstance(v, DataParallel):
                return v._fleet_buckets
        s = w.strategy
        return BucketConfig(s.fuse_grad_size_in_MB, s.last_comm_group_size_MB, s.fuse_all_reduce_ops)

    def _check_batch(self, position: int, value: Any, w: World) -> Any:
        multiprocess = jax.process_count() > 1

        def check(x: Any) -> Any:
            is_local = multiprocess and not (isinstance(x, jax.Array) and not x.is_fully_addressable)
            replicas = w.num_local_replicas if is_local else w.num_replicas
            if np.ndim(x) == 0 or np.shape(x)[0] % replicas:
                what = "process-local" if is_local else "global"
                raise FleetConfigError(
                    f"argument {position} is split over replicas along its leading axis, but "
                    f"its {what} shape {tuple(np.shape(x))} has a leading axis that is not "
                    f"a multiple of the {replicas} replicas; use a batch size that is a "
                    f"multiple of {replicas} (or drop_last=True in the sampler), or pass "
                    "batch_argnums to distributed_step if this argument is not batch data"
                )
            if is_local:
                return jax.make_array_from_process_local_data(w.batch, np.asarray(x))
            return x

        return jax.tree.map(check, value)

    def _compiled(self, plan: _Plan) -> Callable:
        jitted = self._jitted.get(plan.mesh)
        if jitted is None:
            w = world()
            repl, batch = w.replicated, w.batch
            jitted = jax.jit(
                self._global,
                static_argnums=0,
                in_shardings=(repl, repl, batch, repl, batch, repl),
            )
            self._jitted[plan.mesh] = jitted
        return functools.partial(jitted, plan)

    # -- the traced program ------------------------------------------------------------

    def _global(self, plan: _Plan, state, trees, batch, repl, accum, count):
        specs = (P(), P(), P(DATA_AXIS), P(), P(DATA_AXIS), P())
        args = (state, trees, batch, repl, accum, count)
        out_kinds: list[str] = []
        probe = jax.shard_map(
            functools.partial(self._body, plan, probe=True, out_kinds=out_kinds),
            mesh=plan.mesh, in_specs=specs, out_specs=P(DATA_AXIS), check_vma=False,
        )
        jax.eval_shape(probe, *args)
        out_specs = (P(), [P() if k == "state" else P(DATA_AXIS) for k in out_kinds],
                     P(DATA_AXIS))
        self.trace_count += 1
        run = jax.shard_map(
            functools.partial(self._body, plan, probe=False, out_kinds=[]),
            mesh=plan.mesh, in_specs=specs, out_specs=out_specs, check_vma=False,
        )
        new_state, out_leaves, new_accum = run(*args)
        # Scalars come out as one value per replica; their mean (or, for counts,
        # sum) is taken here, outside the per-device body, so the body's only
        # psums are the gradient buckets (and a no_sync step has none).
        out_leaves = [
            (x.mean(0) if jnp.issubdtype(x.dtype, jnp.inexact) else x.sum(0)) if k == "scalar" else x
            for x, k in zip(out_leaves, out_kinds)
        ]
        return new_state, jax.tree_util.tree_unflatten(self._out_treedef, out_leaves), new_accum

    def _body(self, plan: _Plan, state, trees, batch, repl, accum, count, *, probe, out_kinds):
        objs = nnx.merge(plan.graphdef, jax.tree_util.tree_unflatten(plan.state_treedef, state))
        sources = {_NNX: iter(objs), _TREE: iter(trees), _BATCH: iter(batch),
                   _REPL: iter(repl), _STATIC: iter(plan.statics)}
        values = [next(sources[k]) for k in plan.kinds]
        n_pos = len(values) - len(plan.kw_names)
        trace = _context.StepTrace(
            num_replicas=plan.mesh.devices.size,
            buckets=plan.buckets,
            no_sync=plan.no_sync,
            accum=None if accum is None else [a[0] for a in accum],
            accum_count=count,
        )
        with _context.tracing(trace):
            out = self._fn(*values[:n_pos], **dict(zip(plan.kw_names, values[n_pos:])))
        if plan.has_accum and not plan.no_sync and not trace.accum_consumed:
            raise FleetError(
                "this step follows steps run under no_sync, but it did not update the "
                "optimizer; the accumulated gradients would be lost. Call "
                "optimizer.update (of a fleet.distributed_optimizer) in the step"
            )
        graphdef, new = nnx.split(objs)
        if graphdef != plan.graphdef:
            raise FleetError(
                "the step changed the structure of an NNX object (added or removed a "
                "variable or sub-module); build the whole model before training"
            )
        new_state = jax.tree_util.tree_leaves(new)
        if not plan.no_sync:
            new_state = _average_buffers(new, state, new_state, plan.buckets)
        leaves, kinds = self._outputs(out, [v for v, k in zip(values, plan.kinds) if k == _TREE])
        new_accum = None if trace.new_accum is None else [a[None] for a in trace.new_accum]
        if probe:
            out_kinds.extend(kinds)
            expand = functools.partial(jax.tree.map, lambda x: jnp.expand_dims(x, 0))
            return expand(new_state), expand(leaves), new_accum
        return new_state, leaves, new_accum

    def _outputs(self, out: Any, state_args: list) -> tuple[list, list[str]]:
        signatures = {_signature(s) for s in state_args}

        def is_state(x: Any) -> bool:
            if isinstance(x, nnx.Pytree):
                raise FleetTypeError(
                    "a distributed step returned an NNX object; NNX objects passed to the "
                    "step are updated in place, so return only arrays (loss, metrics)"
                )
            return bool(signatures) and jax.tree_util.tree_leaves(x) != [] and (
                _signature(x) in signatures
            )

        parts, treedef = jax.tree_util.tree_flatten(out, is_leaf=is_state)
        leaves, kinds = [], []
        for part in parts:
            if is_state(part):
                leaves.append(part)
                kinds.append("state")
                continue
            x = jnp.asarray(part)
            if x.ndim == 0:
                leaves.append(x[None])
                kinds.append("scalar")
            else:
                leaves.append(x)
                kinds.append("example")
        self._out_treedef = treedef
        return leaves, kinds


def distributed_step(
    fn: Callable | None = None, *, batch_argnums: Sequence[int] | None = None
) -> Any:
    """Runs a train or eval step data-parallel; use it instead of ``jax.jit``.

    See the module docstring (``fleet._step``) for how arguments and outputs are
    told apart. Call it after ``fleet.init``.

    Args:
        fn: the step, written as for one device.
        batch_argnums: positions of the batch arguments (default: inferred).

    Example:
        >>> @fleet.distributed_step  # doctest: +SKIP
        ... def train_step(model, optimizer, x, y):
        ...     loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        ...     optimizer.update(model, grads)
        ...     return loss
    """
    if fn is None:
        return lambda f: DistributedStep(f, batch_argnums)
    if not callable(fn):
        raise FleetTypeError(f"distributed_step decorates a function, got {type(fn).__name__}")
    return DistributedStep(fn, batch_argnums)
