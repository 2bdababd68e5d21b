"""``fleet.distributed_step``: the decorator that replaces ``jax.jit`` on a step.

The step runs once per replica (``jax.shard_map`` over the ``data`` axis, the
engine under today's ``jax.pmap``) inside one ``jax.jit``, with
``check_vma=True``: JAX types every value as *invariant* (the same on every
replica) or *varying*, and fleet reads those types to combine the outputs.

The contract: for every step fleet accepts, every result -- parameters,
optimizer state, buffers, every returned value -- equals what the
single-device step returns on the same global batch (within float rounding);
otherwise the first call raises a :class:`fleet.FleetError` that names the
argument or output and says what to write instead. The one assumption, as in
DDP and Paddle: the loss is a mean over the examples of the batch (gradients
are averaged over replicas, so a loss *summed* over the batch gets gradients N
times smaller than on one device).

Arguments (``batch_argnums=None``):

* **state**, replicated on every device: NNX objects (modules, optimizers,
  ``fleet.DataParallel``), updated in place, and dataclass pytrees such as
  Flax's ``TrainState``;
* **batch**, split along the leading axis: arrays (numpy or jax) and tuples,
  lists and dicts of them. In a multi-process job a numpy batch is this
  process's rows of the global batch; a ``jax.Array`` is the global batch.
  Arrays already replicated over the mesh (what a step returned: parameters,
  averaged gradients) are state, not batch;
* **replicated values**: Python and numpy scalars (traced: no recompiles);
* **static**: anything else hashable (strings, ``None``, functions).

``batch_argnums=(2, 3)`` says which positional arguments are the batch; every
other array argument is then replicated state (raw parameter pytrees).

Gradients: a wrapped model's parameters (``fleet.distributed_model`` /
``fleet.DataParallel``) are averaged over the replicas in their backward pass
(:mod:`fleet._sync`), so any optimizer sees the global-batch gradient. A
gradient of other state (an unwrapped model) would be *summed* over replicas
by JAX; fleet refuses such a step and says to wrap the model.

Outputs, leaf by leaf:

* a value that is the same on every replica (invariant: a new ``TrainState``,
  new parameters, averaged gradients) comes back as it is;
* a value that differs across replicas is combined: a floating-point scalar by
  its mean over replicas (the global-batch value, when it is a per-example
  mean such as a loss or an accuracy), an integer or boolean scalar by its sum
  (a count), and an array whose leading axis is the replica's batch rows is
  per example, gathered in global batch order;
* anything else raises, unless declared: ``distributed_step(fn,
  out_reduce=...)`` takes a pytree prefix of the output with ``"mean"``,
  ``"sum"``, ``"gather"`` or ``None`` (the rule above) at each position, e.g.
  ``out_reduce=(None, "sum")`` for ``return loss, float_count``.

Buffers a step changes from its replica's rows (batch-norm statistics) are
averaged over the replicas, so replicated state stays equal everywhere.

The step compiles once per input shape (and once more for the steps under
``no_sync``). In a multi-process job, before a newly compiled step runs, the
processes compare what they traced (shapes, strategy, buckets) and a mismatch
raises on every process, naming the ranks and the field.
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet import _compat, _context, _guards, _roles, _sharding, _sync, _worker
from fleet._errors import FleetConfigError, FleetError, FleetTypeError
from fleet._replicas import check_replicas
from fleet._tree import dotted
from fleet._world import DATA_AXIS, World, world


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
    check_nan_inf: bool
    mesh: Any
    grad_merge: str | None = None  # strategy.gradient_merge: "local" calls, then "final"
    sharded: bool = False  # strategy.sharding: the step holds sharded optimizer state
    tree_shards: Any = None  # the trees' structure, with sharded leaves (fleet._sharding.Shard)

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


class _GraphCache:
    """The NNX objects' graph, split once and reused while their structure holds."""

    def __init__(self, objs: tuple, positions: list[int]):
        self.objs = objs
        self.tree_vars, self.treedef = self._tree_view(objs)
        self.graphdef, state = nnx.split(objs)
        with_path = jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
        self.variables = [v for _, v in with_path]
        index = [int(dotted(p[:1])) for p, _ in with_path]
        self.names = [
            f"argument {positions[i]} ({type(objs[i]).__name__}) variable {dotted(p[1:])!r}"
            for i, (p, _) in zip(index, with_path)
        ]
        self.state_treedef = jax.tree_util.tree_structure(state)
        self.synced = [isinstance(v, _sync.SyncedRead) for v in self.variables]
        # Per-replica state (no_sync accumulators): sharded over data, varying inside.
        self.per_replica = tuple(isinstance(v, _sync.PerReplica) for v in self.variables)
        self.accum_keys = [p[-1].key.replace(":", ".")
                           if isinstance(v, _sync.GradAccumulator) else None
                           for p, v in with_path]
        self.sharded = any(isinstance(v, _sharding.ShardedState) for v in self.variables)
        # Plain array variables: read and written through Flax's raw fields
        # (fleet/_compat.py), skipping Variable.__setattr__'s trace checks.
        self.fast = _compat.fast_variables(self.variables) and (
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
            return _compat.read_raw(self.variables)
        return [v.get_raw_value() for v in self.variables]

    def write(self, values: Sequence) -> None:
        if self.fast:  # outside any trace: skip Variable.__setattr__'s trace checks
            _compat.write_raw(self.variables, values)
        else:
            for v, x in zip(self.variables, values):
                v.set_raw_value(x)


def _is_buffer(v: nnx.Variable) -> bool:
    """Model state that is neither a parameter nor optimizer state (batch-norm
    statistics): each replica updates it from its own rows."""
    from flax.nnx.training.optimizer import OptState

    return not isinstance(v, (nnx.Param, OptState)) and jnp.issubdtype(
        jnp.result_type(v.get_raw_value()), jnp.inexact)


def _prepare_accumulators(objs: tuple) -> bool:
    """Before a no_sync step: gives each distributed optimizer its accumulator for
    the wrapped parameters among ``objs``. Returns whether a graph changed."""
    from fleet._optimizer import DistributedOptimizer
    from fleet._tree import module_variables

    optimizers = [o for o in objs if isinstance(o, DistributedOptimizer)
                  and getattr(o, "grad_accum", None) is None]
    if not optimizers:  # (the usual case: created at the first no_sync step)
        return False
    params = {}
    for obj in objs:
        if not isinstance(obj, DistributedOptimizer):
            params.update({k: (v.get_raw_value().shape, v.get_raw_value().dtype)
                           for k, v in module_variables(obj).items()
                           if isinstance(v, _sync.SyncedRead)})
    return any([o.ensure_accumulator(params) for o in optimizers])


_SHARD_GRADS_READ = (
    "strategy.sharding: the step reads the wrapped model's gradients outside "
    "optimizer.update ({what}). Under sharding each replica holds only its slice of the "
    "reduced gradient, and nnx.grad / jax.grad return placeholders, so a gradient norm, "
    "a returned gradient or a hand-made change would be wrong. Do it in the optax chain "
    "(optax.clip_by_global_norm), or turn strategy.sharding off")


def _prepare_sharding(objs: tuple) -> bool:
    """``strategy.sharding``: before the first step, each distributed optimizer
    splits its state for the parameters of the model it gets here. Returns
    whether a graph changed."""
    from fleet._optimizer import DistributedOptimizer

    changed = False
    for opt in objs:
        if isinstance(opt, DistributedOptimizer) and opt.shard_pending:
            changed |= opt.ensure_sharded([o for o in objs if o is not opt])
    return changed


def _tree_layout(tree_shards: tuple, sharded: Any, other: Any) -> list:
    """The tree arguments' structure with ``sharded`` at their sharded optimizer
    state (fleet._sharding.Shard) and ``other`` elsewhere: their specs or shardings."""
    structure, flags = tree_shards
    return jax.tree.unflatten(structure, [sharded if f else other for f in flags])


def _tree_rows(trees: list) -> list:
    """Sharded tree leaves entering the body: the replica's row."""
    return jax.tree.map(lambda x: _sharding.Shard(x.value[0], x.layout)
                        if _sharding.is_shard(x) else x, trees, is_leaf=_sharding.is_shard)


class DistributedStep:
    """A step function run data-parallel; see :func:`distributed_step`."""

    def __init__(self, fn: Callable, batch_argnums: Sequence[int] | None, out_reduce: Any):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self._out_reduce = out_reduce
        self._jitted: dict[Any, Callable] = {}
        self._graph: _GraphCache | None = None
        self._last_plan: _Plan | None = None
        self._records: dict[_Plan, dict] = {}
        self._agreed: set = set()
        self._calls = 0
        self._last_repl: Any = None
        self._merge_seen: dict[int, tuple] = {}  # id(optimizer) -> (count array, its value)
        self.trace_count = 0  # how often the body was traced for real (tests read it)

    # -- the call, on the host ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _worker.step_begin()
        plan, call_args = self._prepare(args, kwargs)
        compiled = self._compiled(plan)
        new_state, out, finite = compiled(*call_args)
        if plan.check_nan_inf:
            _guards.check_finite(finite, self._records[plan]["finite"], self._calls + 1)
        self._graph.write(new_state)
        if plan.grad_merge is not None and self._records[plan]["merge_updates"]:
            self._merge_advanced(self._graph.objs)
        self._calls += 1
        every = world().strategy.check_replicas_every_n_steps
        if every and self._calls % every == 0:
            self._check_replicas(out)
        _worker.step_end()
        return out

    def make_jaxpr(self, *args: Any, **kwargs: Any) -> Any:
        """The jaxpr of the program a call with these arguments runs (nothing runs,
        nothing is updated). Its ``shard_map`` body shows the gradient buckets."""
        plan, call_args = self._prepare(args, kwargs)
        return jax.make_jaxpr(self._global, static_argnums=0)(plan, *call_args)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The ``jax.stages.Lowered`` program a call with these arguments runs
        (nothing runs): ``.compile().memory_analysis()`` gives its memory."""
        plan, call_args = self._prepare(args, kwargs)
        self._compiled(plan)
        return self._jitted[(plan.mesh, plan.tree_shards)].lower(plan, *call_args)

    def _check_replicas(self, out: Any) -> None:
        state = dict(zip(self._graph.names, (v.get_raw_value() for v in self._graph.variables)))
        bad = check_replicas(state) + [f"output {b}" for b in check_replicas(out)]
        if bad:
            raise FleetError(
                f"replicated values differ across replicas after call {self._calls}: "
                f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                + ". Something outside fleet changed one replica's copy; fleet.check_replicas "
                "lists them all"
            )

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[_Plan, tuple]:
        w = world()
        names = tuple(sorted(kwargs))
        values = list(args) + [kwargs[k] for k in names]
        self._check_argnums(len(args))
        batch_argnums = self._batch_argnums
        kinds = tuple(
            _roles.kind(v, None if batch_argnums is None else i in batch_argnums, w.num_replicas)
            for i, v in enumerate(values)
        )
        positions = [i for i, k in enumerate(kinds) if k == _roles.NNX]
        objs = tuple(values[i] for i in positions)
        no_sync = _context.no_sync_active()
        merging, position = self._merge_position(objs, no_sync)
        grad_merge = None
        if merging is not None:
            grad_merge = "final" if position == merging.merge_k - 1 else "local"
            no_sync = grad_merge == "local"
        if no_sync and _prepare_accumulators(objs):
            self._graph = None
        if w.strategy.sharding and _prepare_sharding(objs):
            self._graph = None
        if self._graph is None or not self._graph.holds(objs):
            self._graph = _GraphCache(objs, positions)
        trees = [v for v, k in zip(values, kinds) if k == _roles.TREE]
        tree_shards = None
        if w.strategy.sharding and trees:
            leaves, structure = jax.tree.flatten(trees, is_leaf=_sharding.is_shard)
            flags = tuple(map(_sharding.is_shard, leaves))
            if any(flags):
                tree_shards = (structure, flags)
        plan = self._plan(
            sharded=self._graph.sharded or tree_shards is not None,
            tree_shards=tree_shards,
            kinds=kinds,
            kw_names=names,
            statics=tuple(v for v, k in zip(values, kinds) if k == _roles.STATIC),
            graphdef=self._graph.graphdef,
            state_treedef=self._graph.state_treedef,
            no_sync=no_sync,
            check_nan_inf=w.strategy.check_nan_inf,
            mesh=w.mesh,
            grad_merge=grad_merge,
        )
        batch = [v for v, k in zip(values, kinds) if k == _roles.BATCH]
        repl = [v for v, k in zip(values, kinds) if k == _roles.REPL]
        if jax.process_count() > 1:
            shapes = (plan, tuple(np.shape(x) for x in jax.tree.leaves(batch)))
            if shapes not in self._agreed:
                _guards.agree_program(self._fn, kinds, no_sync, batch, self._graph.read(), w)
                self._agreed.add(shapes)
            self._last_repl = _guards.agree_replicated(self._fn, kinds, repl, self._last_repl)
        call_args = (
            self._graph.read(),
            trees,
            [self._check_batch(i, v, w) for i, (v, k) in enumerate(zip(values, kinds))
             if k == _roles.BATCH],
            [v for v, k in zip(values, kinds) if k == _roles.REPL],
        )
        return plan, call_args

    def _merge_position(self, objs: tuple, no_sync: bool) -> tuple[Any, int]:
        """``strategy.gradient_merge``: the optimizer that merges, and where this
        call sits in its cycle of ``k_steps`` calls. The count lives on the
        device (it is checkpointed); the host follows it without reading it back,
        and reads it only when someone else wrote it (a restore)."""
        from fleet._optimizer import DistributedOptimizer

        merging = [o for o in objs if isinstance(o, DistributedOptimizer) and o.merge_k > 1]
        if not merging or no_sync:  # explicit no_sync: accumulate, do not count
            return None, 0
        positions = []
        for opt in merging:
            value = opt.merge_count.get_raw_value()
            seen = self._merge_seen.get(id(opt))
            if seen is None or seen[0] is not value:
                seen = (value, int(np.asarray(value.addressable_shards[0].data)))
                self._merge_seen[id(opt)] = seen
            positions.append(seen[1])
        if len(set(positions)) > 1:
            raise FleetError(
                f"the step gets {len(merging)} optimizers that merge gradients, at different "
                f"points of their cycle ({positions}); pass one distributed optimizer")
        return merging[0], positions[0]

    def _merge_advanced(self, objs: tuple) -> None:
        """After a call that updated a merging optimizer: its new count, known."""
        from fleet._optimizer import DistributedOptimizer

        for opt in objs:
            seen = self._merge_seen.get(id(opt))
            if isinstance(opt, DistributedOptimizer) and seen is not None:
                self._merge_seen[id(opt)] = (opt.merge_count.get_raw_value(),
                                             (seen[1] + 1) % opt.merge_k)

    def _check_argnums(self, n_positional: int) -> None:
        if self._batch_argnums is not None:
            bad = [i for i in self._batch_argnums if i >= n_positional]
            if bad:
                raise FleetConfigError(
                    f"batch_argnums={self._batch_argnums} names position(s) {bad}, but the "
                    f"step was called with {n_positional} positional arguments (0.."
                    f"{n_positional - 1}); give the positions of the batch arguments"
                )

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

    def _check_batch(self, position: int, value: Any, w: World) -> Any:
        multiprocess = jax.process_count() > 1

        def check(x: Any) -> Any:
            is_local = multiprocess and not (isinstance(x, jax.Array) and not x.is_fully_addressable)
            replicas = w.num_local_replicas if is_local else w.num_replicas
            if np.ndim(x) > 0 and np.shape(x)[0] == 0:
                raise FleetConfigError(
                    f"argument {position} is a batch of 0 rows (shape {tuple(np.shape(x))}); "
                    "a step needs at least one row per replica: skip empty batches, or use "
                    "drop_last=True in the sampler"
                )
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
            if isinstance(x, jax.Array) and x.sharding != w.batch:
                return jax.device_put(x, w.batch)
            return x

        return jax.tree.map(check, value)

    def _compiled(self, plan: _Plan) -> Callable:
        jitted = self._jitted.get((plan.mesh, plan.tree_shards))
        if jitted is None:
            w = world()
            repl, batch = w.replicated, w.batch
            trees = repl if plan.tree_shards is None else _tree_layout(
                plan.tree_shards, NamedSharding(plan.mesh, P(DATA_AXIS)), repl)
            jitted = jax.jit(
                self._global,
                static_argnums=0,
                in_shardings=(None, trees, batch, repl),
            )
            self._jitted[(plan.mesh, plan.tree_shards)] = jitted

        def run(state, trees, batch, repl):
            try:
                return jitted(plan, state, trees, batch, repl)
            except ValueError:
                # Arrays committed elsewhere (a new TrainState's step counter, arrays
                # made on one device) are refused by jit: if the arguments' own
                # shardings say so, place them on the mesh and go on.
                placed = self._placed(state, trees, repl)
                if placed is None:
                    raise
                return jitted(plan, placed[0], placed[1], batch, placed[2])

        return run

    def _placed(self, state: list, trees: Any, repl: Any) -> tuple | None:
        """The state, tree and replicated arguments placed on the mesh, or ``None``
        when every array is already where the step expects it."""
        w = world()
        data = NamedSharding(w.mesh, P(DATA_AXIS))
        misplaced = []

        def place(x: Any, where: NamedSharding) -> Any:
            # Only a committed jax.Array can be refused: jit places anything else itself.
            if not isinstance(x, jax.Array) or x.sharding.is_equivalent_to(where, x.ndim):
                return x
            misplaced.append(x)
            return jax.device_put(x, where)

        repl = jax.tree.map(lambda x: place(x, w.replicated), repl)
        trees = jax.tree.map(
            lambda x: _sharding.Shard(place(x.value, data), x.layout)
            if _sharding.is_shard(x) else place(x, w.replicated),
            trees, is_leaf=_sharding.is_shard)
        state = [x if pr else place(x, w.replicated)
                 for x, pr in zip(state, self._graph.per_replica)]
        return (state, trees, repl) if misplaced else None

    # -- the traced program ------------------------------------------------------------

    def _global(self, plan: _Plan, state, trees, batch, repl):
        state_specs = [P(DATA_AXIS) if pr else P() for pr in self._graph.per_replica]
        tree_specs = P() if plan.tree_shards is None else _tree_layout(
            plan.tree_shards, P(DATA_AXIS), P())
        specs = (state_specs, tree_specs, P(DATA_AXIS), P())
        args = (state, trees, batch, repl)
        record = self._records.get(plan)
        if record is None:
            strategy = world().strategy
            _guards.check_on_one_device(
                functools.partial(self._body, plan, record={}, probe=True), plan.mesh, args, specs)
            record = {}
            probe = jax.shard_map(
                functools.partial(self._body, plan, record=record, probe=True),
                mesh=plan.mesh, in_specs=specs, out_specs=(), check_vma=True,
            )
            jaxpr = jax.make_jaxpr(probe)(*args)
            if _guards.foreign_psums(jaxpr):
                summed = _guards.summed_state(jaxpr, plan.kinds, self._graph.names, trees)
                # Gradients of replicated state that no wrapped model synced: JAX summed
                # them. A distributed optimizer that got them, with no wrapped model in
                # the step, divides them by N (raw parameters, functional optax style).
                if record["wrapped_syncs"] or not record["tx_calls"]:
                    raise FleetError(_guards.IMPLICIT_SUM.format(
                        n=plan.mesh.devices.size,
                        what=", ".join(summed[:3]) + (" ..." if len(summed) > 3 else "")
                        if summed else "state that is not a wrapped model's parameters"))
                record["auto_sum"] = True
                if strategy.amp:
                    raise FleetError(
                        "strategy.amp sets the computation dtype of a wrapped model's layers, "
                        "and this step trains raw parameters (no wrapped model): wrap an NNX "
                        "model with fleet.distributed_model, or turn strategy.amp off")
            if record["shard_grads"]:
                used = _guards.placeholder_uses(jaxpr)
                if used:
                    raise FleetError(_SHARD_GRADS_READ.format(what=", ".join(used[:3])))
            merge = strategy.gradient_merge_configs
            if (strategy.gradient_merge and merge.k_steps > 1 and record["wrapped_syncs"]
                    and plan.grad_merge is None):
                raise FleetError(
                    f"strategy.gradient_merge (k_steps={merge.k_steps}) merges gradients in the "
                    "distributed optimizer, and this step differentiates the wrapped model "
                    "without one: pass fleet.distributed_optimizer(nnx.Optimizer(model, tx, "
                    "wrt=nnx.Param)) to the step and update with it")
            self._records[plan] = record
        out_specs = (state_specs,
                     [P() if r == "replicated" else P(DATA_AXIS) for r in record["out"]],
                     P(DATA_AXIS))
        self.trace_count += 1
        run = jax.shard_map(
            functools.partial(self._body, plan, record=record, probe=False),
            mesh=plan.mesh, in_specs=specs, out_specs=out_specs, check_vma=True,
        )
        new_state, out_leaves, finite = run(*args)
        # Stacked per-replica values are combined here, outside the per-device body,
        # so the body's only collectives are the gradient buckets and buffer means.
        out_leaves = [
            x.mean(0) if r == "mean" else x.sum(0) if r == "sum"
            else _sharding.Shard(x, r[1]) if isinstance(r, tuple) else x
            for x, r in zip(out_leaves, record["out"])
        ]
        return new_state, jax.tree_util.tree_unflatten(record["treedef"], out_leaves), finite

    def _body(self, plan: _Plan, state, trees, batch, repl, *, record, probe):
        per_replica = self._graph.per_replica
        state = [x[0] if pr else x for x, pr in zip(state, per_replica)]
        if plan.tree_shards is not None:
            trees = _tree_rows(trees)
        original = state
        if plan.no_sync:  # local gradients: the wrapped parameters vary inside no_sync
            state = [jax.lax.pcast(x, DATA_AXIS, to="varying") if synced else x
                     for x, synced in zip(state, self._graph.synced)]
        objs = nnx.merge(plan.graphdef, jax.tree_util.tree_unflatten(plan.state_treedef, state))
        entered = {id(x): i for i, (x, synced) in enumerate(zip(state, self._graph.synced))
                   if synced and plan.no_sync}
        sources = {_roles.NNX: iter(objs), _roles.TREE: iter(trees), _roles.BATCH: iter(batch),
                   _roles.REPL: iter(repl), _roles.STATIC: iter(plan.statics)}
        values = [next(sources[k]) for k in plan.kinds]
        n_pos = len(values) - len(plan.kw_names)
        trace = _sync.SyncTrace(num_replicas=plan.mesh.devices.size, no_sync=plan.no_sync,
                                auto_sum=record.get("auto_sum", False),
                                check_finite=plan.check_nan_inf)
        trace.accum_in = {k: x for k, x in zip(self._graph.accum_keys, state) if k is not None}
        self._strategy_in_trace(trace, objs, plan)
        with _sync.tracing(trace):
            out = self._fn(*values[:n_pos], **dict(zip(plan.kw_names, values[n_pos:])))
            graphdef, new = nnx.split(objs)
            if graphdef != plan.graphdef:
                raise FleetError(
                    "the step changed the structure of an NNX object (added or removed a "
                    "variable or sub-module); build the whole model before training"
                )
            new_state = self._replicated_state(new, plan, entered, original)
            leaves, reduces, treedef = _roles.combine_outputs(out, batch, self._out_reduce)
        if trace.shard_grads and any(id(x) in trace.shard_grads for x in jax.tree.leaves(out)):
            raise FleetError(_SHARD_GRADS_READ.format(what="the step returns them"))
        if trace.auto_sum and any(id(x) in trace.tx_grads for x in jax.tree.leaves(out)):
            raise FleetError(
                "the step returns gradients of raw parameters, which JAX summed over the "
                f"{trace.num_replicas} replicas; wrap the model (fleet.distributed_model) to "
                "get averaged gradients back from a step"
            )
        trace.record_finite([f"output {dotted(p) or 'the output'}" for p in
                             [q for q, _ in jax.tree_util.tree_flatten_with_path(out)[0]]], leaves)
        flags = jnp.stack([f for _, f in trace.finite]) if trace.finite else jnp.zeros((0,), bool)
        if not _sync.is_varying(flags):
            flags = jax.lax.pcast(flags, DATA_AXIS, to="varying")
        if probe:
            record.update(finite=[n for n, _ in trace.finite])
            record.update(out=reduces, treedef=treedef, wrapped_syncs=trace.wrapped_syncs,
                          tx_calls=trace.tx_calls, merge_updates=trace.merge_updates,
                          shard_grads=len(trace.shard_grads))
            return ()
        out_leaves = [x if r == "replicated" else (x[None] if r in ("mean", "sum")
                                                   or isinstance(r, tuple) else x)
                      for x, r in zip(leaves, reduces)]
        new_state = [x[None] if pr else x for x, pr in zip(new_state, per_replica)]
        return new_state, out_leaves, flags

    @staticmethod
    def _strategy_in_trace(trace: _sync.SyncTrace, objs: tuple, plan: _Plan) -> None:
        """What the strategy's sections need from the step's distributed optimizer:
        float16 amp's loss scale, gradient merge's divisor on the final call."""
        from fleet._optimizer import DistributedOptimizer

        divisor = None
        for opt in objs:
            if not isinstance(opt, DistributedOptimizer):
                continue
            if opt.amp_rules is not None and trace.loss_scale is None:
                trace.loss_scale = divisor = opt.loss_scaling[...]
            if plan.grad_merge == "final" and opt.merge_avg:
                k = jnp.asarray(opt.merge_k, jnp.float32)
                divisor = k if divisor is None else divisor * k
        trace.grad_divisor = divisor
        trace.merge_counts = plan.grad_merge is not None
        if plan.sharded:
            trace.shard = _sharding.config(replicas=plan.mesh.devices.size)

    def _replicated_state(self, new: Any, plan: _Plan, entered: dict, original: list) -> list:
        """The NNX state the step leaves: buffers averaged, anything else varying refused."""
        variables = jax.tree_util.tree_leaves(new, is_leaf=lambda v: isinstance(v, nnx.Variable))
        leaves = [v.get_raw_value() for v in variables]
        # Under no_sync the wrapped parameters entered as varying; unchanged, they
        # leave as the invariant values they were.
        leaves = [original[entered[id(x)]] if id(x) in entered else x for x in leaves]
        self._update_accumulators(leaves)
        buffers = [i for i, x in enumerate(leaves)
                   if _sync.is_varying(x) and not self._graph.per_replica[i]]
        for i in buffers:
            if not _is_buffer(variables[i]):
                hint = (
                    " Under no_sync the gradients are local: update with a "
                    "fleet.distributed_optimizer, which does not step inside no_sync."
                    if plan.no_sync else
                    " Compute its gradient through a wrapped model (fleet.distributed_model), "
                    "or do not write values computed from the batch into it."
                )
                raise FleetError(
                    f"{self._graph.names[i]} would hold different values on different "
                    f"replicas after this step (it was set from per-replica values).{hint}"
                )
        if buffers:
            for i, x in zip(buffers, _sync.mean_over_replicas([leaves[i] for i in buffers])):
                leaves[i] = x
        return leaves

    def _update_accumulators(self, leaves: list) -> None:
        """The no_sync accumulators the step leaves: what this step added, zeros once
        a synced step consumed them, else as they were (a step that does not
        differentiate the model leaves them for the next one that does)."""
        trace = _sync.current()
        for i, key in enumerate(self._graph.accum_keys):
            if key is None:
                continue
            if key in trace.accum_out:
                new = trace.accum_out[key]
                leaves[i] = jnp.zeros_like(leaves[i]) if new is None else new

def distributed_step(
    fn: Callable | None = None,
    *,
    batch_argnums: Sequence[int] | None = None,
    out_reduce: Any = None,
) -> Any:
    """Runs a train or eval step data-parallel; use it instead of ``jax.jit``.

    See the module docstring (``fleet._step``) for the contract and for how
    arguments and outputs are told apart. Call it after ``fleet.init``.

    Args:
        fn: the step, written as for one device.
        batch_argnums: positions of the batch arguments (default: inferred).
        out_reduce: how to combine outputs that differ across replicas: ``"mean"``,
            ``"sum"``, ``"gather"`` or ``None`` (the default rule), as one string
            or a pytree prefix of the output.

    Example:
        >>> @fleet.distributed_step  # doctest: +SKIP
        ... def train_step(model, optimizer, x, y):
        ...     loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        ...     optimizer.update(model, grads)
        ...     return loss
    """
    if batch_argnums is not None:
        if isinstance(batch_argnums, int):
            batch_argnums = (batch_argnums,)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                   for i in batch_argnums):
            raise FleetConfigError(
                f"batch_argnums={batch_argnums!r} must be non-negative ints (positions of "
                "the batch arguments), e.g. batch_argnums=(2, 3)"
            )
    if fn is None:
        return lambda f: DistributedStep(f, batch_argnums, out_reduce)
    if not callable(fn):
        raise FleetTypeError(f"distributed_step decorates a function, got {type(fn).__name__}")
    return DistributedStep(fn, batch_argnums, out_reduce)
