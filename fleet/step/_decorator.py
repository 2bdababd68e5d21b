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
* **static**: anything else hashable (strings, ``None``, functions), and the
  arguments ``static_argnums`` / ``static_argnames`` name (a ``train`` flag).

``batch_argnums=(2, 3)`` says which positional arguments are the batch; every
other array argument is then replicated state (raw parameter pytrees).

Gradients: a wrapped model's parameters (``fleet.distributed_model`` /
``fleet.DataParallel``) are averaged over the replicas in their backward pass
(:mod:`fleet.comm._sync`), so any optimizer sees the global-batch gradient. A
gradient of other state (an unwrapped model) would be *summed* over replicas
by JAX; fleet refuses such a step and says to wrap the model.

Outputs, leaf by leaf:

* a value that is the same on every replica (invariant: a new ``TrainState``,
  new parameters, averaged gradients) comes back as it is;
* a scalar that differs across replicas is combined by the reduction over the
  batch rows that made it, read from the traced step (:mod:`fleet.semantics._outputs`):
  a mean (``.mean()``, an accuracy) by the mean over replicas, a sum (a count,
  also cast to float) by the sum, ``jnp.max`` / ``jnp.min`` by the max / min; a
  scalar with no such combination (a standard deviation, a ratio of sums) is
  refused, and so is a returned loss summed over the batch (its averaged
  gradients would be N times smaller); an array whose leading axis is the
  replica's batch rows is per example, gathered in global batch order;
* anything else raises, unless declared: ``distributed_step(fn,
  out_reduce=...)`` takes a pytree prefix of the output with ``"mean"``,
  ``"sum"``, ``"max"``, ``"min"``, ``"gather"`` or ``None`` (the rule above) at
  each position, e.g. ``out_reduce=(None, "max")`` for ``return loss, jnp.std(x)``
  to combine the replicas' values by their max.

Buffers a step changes from its replica's rows (batch-norm statistics) are
averaged over the replicas, so replicated state stays equal everywhere.

The NNX objects' old state is donated to the step (``fleet.step._donate``): XLA writes
the new state into its buffers. An array read from a variable before a call
and still held keeps its value, as under ``nnx.jit`` (fleet donates a copy of
it); ``donate=False`` donates nothing; pytree arguments are never donated.
A call does not wait for the device, ``strategy.check_nan_inf`` included: its
error is raised at a later call or at :meth:`DistributedStep.wait`
(``fleet.sections._finite``).

The step compiles once per input shape (and once more for the steps under
``no_sync``). In a multi-process job, before a newly compiled step runs, the
processes compare what they traced (shapes, strategy, buckets) and a mismatch
raises on every process, naming the ranks and the field; processes that all
passed the same batch rows (each passed its whole batch) raise too, naming the
fix (``fleet.step._rows``).

This module is the call path (:class:`DistributedStep`); what a call is, is
decided in ``fleet.step._decide``, and a plan's compiled program is made in
``fleet.step._jitted``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from fleet import _compat
from fleet._errors import FleetError, FleetTypeError
from fleet.comm._replicas import check_replicas
from fleet.runtime import _heartbeat
from fleet.runtime._world import world
from fleet.sections._finite import FiniteFlags
from fleet.step import _donate, _guards, _verify
from fleet.step._decide import Statics, batch_positions, decide
from fleet.step._global_arrays import global_batch
from fleet.step._graph import Plan
from fleet.step._jitted import jitted, runner
from fleet.step._program import Program
from fleet.step._recall import Decision, Recall
from fleet.step._rows import SameRows
from fleet.wrappers._gradient_merge import MergePosition


class DistributedStep:
    """A step function run data-parallel; see :func:`distributed_step`."""

    def __init__(self, fn: Callable, batch_argnums: Sequence[int] | None, out_reduce: Any,
                 donate: bool = True, statics: Statics | None = None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._statics = statics
        self._donate = bool(donate)
        self._finite = FiniteFlags()
        self._batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self._out_reduce = out_reduce
        self._jitted: dict[Any, Callable] = {}
        self._program = Program(fn, out_reduce)
        self._last_plan: Plan | None = None
        self._agreed: set = set()
        self._rows = SameRows(getattr(fn, "__qualname__", repr(fn)))  # (fleet.step._rows)
        self._calls = 0
        self._last_repl: Any = None
        self._merge = MergePosition()
        self._recall: Recall | None = None  # the last call's decisions (fleet.step._recall)
        self._decisions = 0  # calls that took the decision path (_decide)
        self._verify = _verify.Verify(fn)  # strategy.verify_steps (fleet.step._verify)

    # -- the call, on the host ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nnx.cached_partial(step, model, optimizer) hands its graph cache to the NNX
        # transform it calls, through NNX's update context: the step is that
        # transform, and takes the cache (its own recall serves the same purpose).
        # Only then: the context costs every call.
        if _compat.handed_graph_cache():
            with nnx.update_context(self):
                return self._call(*args, **kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        _heartbeat.step_begin()
        if self._finite.due():  # earlier calls' check_nan_inf chains, if ready: no wait
            self._check_finite(wait=False)
        recall = self._recall
        batch = None if recall is None else recall.match(args, kwargs, self._program.graph)
        if batch is not None:  # every input the last decision depended on is as it was
            decided, run, flat = recall.decision, recall.run, recall.flat
            call_args = self._call_args(decided, args, batch)
        else:  # the decision path (fleet.step._recall)
            decided = self._decide(args, kwargs)
            run, flat = self._compiled(decided.plan), False
            call_args = self._call_args(decided, decided.values(args, kwargs))
            self._recall = Recall.of(decided, run, args, call_args[2])
        plan, kinds = decided.plan, decided.kinds
        # strategy.verify_steps: the single-device step on copies, before the donation
        verify = self._verify.active and self._verify.before(plan, kinds, args, kwargs,
                                                             call_args[2])
        chain = self._finite.chain(plan.mesh) if plan.check_nan_inf else None
        # The old NNX state is donated: the new state must be written whatever follows.
        new_state, out, chain = run(*call_args, chain, flat)
        self._program.graph.write(new_state)
        if verify:
            self._verify.after(verify, plan, self._program.graph, out)
        if plan.grad_merge is not None and self._program.records[plan].merge_updates:
            self._merge.advanced(self._program.graph.objs)
        self._calls += 1
        if plan.check_nan_inf:
            self._finite.record(plan.mesh, self._calls, self._program.records[plan].finite,
                                chain)
            if jax.process_count() > 1:  # every process raises at the same call
                self._check_finite(wait=True, upto=self._calls - 1)
        every = world().strategy.check_replicas_every_n_steps
        if every and self._calls % every == 0:
            self._check_finite(wait=True)
            self._check_replicas(out)
        _heartbeat.step_end()
        return out

    def wait(self) -> None:
        """Waits for every call made so far to finish on the device. With
        ``strategy.check_nan_inf``, raises the :class:`fleet.FleetError` of a call
        whose outputs or gradients were not finite (a call otherwise raises it at
        a later call, once its flags are back: see ``fleet.sections._finite``)."""
        self._check_finite(wait=True)
        graph = self._program.graph
        if graph is not None:
            jax.block_until_ready(graph.read())

    def _check_finite(self, *, wait: bool, upto: int | None = None) -> None:
        try:
            self._finite.check(wait=wait, upto=upto)
        except FleetError:
            # The non-finite calls left the merge count where it was: read it again.
            self._merge = MergePosition()
            raise

    @property
    def trace_count(self) -> int:
        """How often the step's body was traced for real (once per input shape)."""
        return self._program.trace_count

    def make_jaxpr(self, *args: Any, **kwargs: Any) -> Any:
        """The jaxpr of the program a call with these arguments runs (nothing runs,
        nothing is updated). Its ``shard_map`` body shows the gradient buckets."""
        plan, call_args = self._prepare(args, kwargs)
        chain = self._finite.chain(plan.mesh) if plan.check_nan_inf else None
        return jax.make_jaxpr(self._program.run, static_argnums=0)(plan, *call_args, chain)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The ``jax.stages.Lowered`` program a call with these arguments runs
        (nothing runs): ``.compile().memory_analysis()`` gives its memory."""
        plan, (state, trees, batch, repl) = self._prepare(args, kwargs)
        self._compiled(plan)
        chain = self._finite.chain(plan.mesh) if plan.check_nan_inf else None
        layout, donated, kept = _donate.split(state, (trees, batch, repl), self._donate)
        return self._jitted[plan].lower(plan, layout, donated, kept, trees, batch, repl, chain)

    def _check_replicas(self, out: Any) -> None:
        graph = self._program.graph
        state = dict(zip(graph.names, (v.get_raw_value() for v in graph.variables)))
        bad = check_replicas(state) + [f"output {b}" for b in check_replicas(out)]
        if bad:
            raise FleetError(
                f"replicated values differ across replicas after call {self._calls}: "
                f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                + ". Something outside fleet changed one replica's copy; fleet.check_replicas "
                "lists them all"
            )

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[Plan, tuple]:
        decided = self._decide(args, kwargs)
        return decided.plan, self._call_args(decided, decided.values(args, kwargs))

    def _decide(self, args: tuple, kwargs: dict) -> Decision:
        """What a call is, and what that depended on: the one decision path
        (fleet.step._decide; a repeated call reuses its result: fleet.step._recall)."""
        self._decisions += 1
        decided = decide(self._program, self._merge, self._batch_argnums, self._last_plan,
                         args, kwargs, self._statics)
        self._last_plan = decided.plan
        return decided

    def _call_args(self, decided: Decision, values: Sequence, batch: list | None = None) -> tuple:
        """The arguments of the compiled program: the NNX state, the pytree
        state, the batch (placed, unless given), the replicated scalars. In a
        multi-process job, every process agrees first on a new program and on
        changed scalars, and checks that they did not all pass the same rows."""
        w = world()
        plan, kinds, at = decided.plan, decided.kinds, decided.positions
        repl = list(at.repl(values))
        if jax.process_count() > 1:
            given = [values[i] for i in at.batch]
            shapes = (plan, tuple(np.shape(x) for x in jax.tree.leaves(given)))
            call = self._calls + 1
            if shapes not in self._agreed:
                prints = _guards.agree_program(self._fn, kinds, plan.no_sync, given,
                                               self._program.graph.read(), w)
                self._rows.check(shapes, prints, at.batch, call)
                self._agreed.add(shapes)
            elif self._rows.due(shapes):  # the first calls passed constant rows
                self._rows.recheck(shapes, given, at.batch, call)
            self._last_repl = _guards.agree_replicated(self._fn, kinds, repl, self._last_repl)
        if batch is None:
            batch = [global_batch(i, values[i], w) for i in at.batch]
        return self._program.graph.read(), list(at.trees(values)), batch, repl

    def _compiled(self, plan: Plan) -> Callable:
        """The call of the plan's compiled program (fleet.step._jitted), one ``jit``
        per plan."""
        if plan not in self._jitted:
            self._jitted[plan] = jitted(self._program, plan)
        return runner(self._jitted, plan, self._program, self._donate)


def distributed_step(
    fn: Callable | None = None,
    *,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    out_reduce: Any = None,
    donate: bool = True,
) -> Any:
    """Runs a train or eval step data-parallel; use it instead of ``jax.jit``.

    See the module docstring (``fleet.step._decorator``) for the contract and for how
    arguments and outputs are told apart. Call it after ``fleet.init``.

    Args:
        fn: the step, written as for one device.
        batch_argnums: positions of the batch arguments (default: inferred).
        static_argnums, static_argnames: arguments taken as static values, as
            ``jax.jit``'s: keys of the compiled program (one program per value),
            which the step may branch on in Python (``if train:``). A Python
            scalar argument not declared static is traced (no recompiles). Each
            completes the other from ``fn``'s signature.
        out_reduce: how to combine outputs that differ across replicas: ``"mean"``,
            ``"sum"``, ``"max"``, ``"min"``, ``"gather"`` or ``None`` (the default rule), as one string
            or a pytree prefix of the output.
        donate: give the NNX objects' old state (parameters, optimizer state,
            buffers) to XLA, which writes the new state into its buffers, as
            ``jax.jit(..., donate_argnums=...)`` does: a device holds that state
            once instead of twice at the step boundary. An array read from a
            variable before the call and still held (``w = model.kernel.value``,
            an optimizer moment) keeps its value, as under ``nnx.jit``: fleet
            donates a device copy of that leaf instead (held twice during the
            step, as without donation). Arrays passed as pytrees (a Linen
            ``TrainState``) are never donated. ``donate=False`` donates nothing
            (the state is then held twice during the step).

    Example:
        >>> @fleet.distributed_step  # doctest: +SKIP
        ... def train_step(model, optimizer, x, y):
        ...     loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        ...     optimizer.update(model, grads)
        ...     return loss
    """
    batch_argnums = batch_positions(batch_argnums)

    def make(f: Callable) -> DistributedStep:
        if not callable(f):
            raise FleetTypeError(f"distributed_step decorates a function, got {type(f).__name__}")
        statics = None
        if static_argnums is not None or static_argnames is not None:
            statics = Statics(f, static_argnums, static_argnames)
            statics.overlap(batch_argnums)
        return DistributedStep(f, batch_argnums, out_reduce, donate, statics)

    return make if fn is None else make(fn)
