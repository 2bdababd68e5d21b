"""A plan's compiled program: :meth:`fleet.step._program.Program.run` under ``jax.jit``.

Moved out of ``fleet.step._decorator`` (``DistributedStep._compiled``, which keeps
one :func:`jitted` per plan and asks :func:`runner` for its call). A plan's first
call compiles its program while the step is checked (:func:`first_program`,
``fleet.step._first_trace``). The NNX objects' old state is donated to the
program (its leaves split into donated and kept ones by ``fleet.step._donate``);
the pytree arguments, the batch and the replicated values are placed by
``in_shardings``, and arguments that ``jit`` refuses because they were committed
elsewhere are placed on the mesh (``fleet.step._global_arrays.placed``) before
one more try.
"""

from __future__ import annotations

import atexit
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet.runtime._world import DATA_AXIS, world
from fleet.step import _donate
from fleet.step._global_arrays import placed as place_on_mesh
from fleet.step._graph import Plan, tree_layout
from fleet.step._program import Program


def jitted(program: Program, plan: Plan) -> Callable:
    """``program.run`` under ``jax.jit`` for the plan's mesh and pytree layout: the
    NNX state donated, the other arguments' shardings given."""
    w = world()
    repl, batch = w.replicated, w.batch
    trees = repl if plan.tree_shards is None else tree_layout(
        plan.tree_shards, NamedSharding(plan.mesh, P(DATA_AXIS)), repl)

    def donating(plan, layout, donated, kept, trees, batch, repl, chain):
        state = _donate.assemble(layout, donated, kept)
        return program.run(plan, state, trees, batch, repl, chain)

    return jax.jit(
        donating,
        static_argnums=(0, 1),
        donate_argnums=2,  # the NNX state the step writes back (fleet.step._donate)
        in_shardings=(None, None, trees, batch, repl, None),
    )


def runner(jits: dict, plan: Plan, program: Program, donate: bool) -> Callable:
    """The call of the plan's compiled program: ``run(state, trees, batch, repl,
    chain, flat=False)`` returns the new state, the outputs and the chain. A
    plan's first call compiles while it is checked (:func:`first_program`); the
    ``jit`` that holds its program is then ``jits[plan]``."""
    jitted, first = jits[plan], plan not in program.records

    def run(state, trees, batch, repl, chain, flat=False):
        nonlocal jitted, first
        if first:  # (state made on one device or on the host, an unwrapped metric's, a
            # TrainState's step=0: on the mesh, as the next calls pass it, so that they
            # find the first call's program in jit's cache)
            state, trees, repl = place_on_mesh(state, program.graph.per_replica, trees,
                                               repl, first=True) or (state, trees, repl)
        # (flat: a recalled call, whose batch and replicated values are arrays
        # and scalars, and which has no trees: fleet.step._recall)
        layout, donated, kept = (_donate.split_flat(state, batch + repl, donate) if flat
                                 else _donate.split(state, (trees, batch, repl), donate))
        try:
            if first:
                jitted = jits[plan] = first_program(program, plan, (
                    layout, donated, kept, trees, batch, repl, chain))
                first = False
            return jitted(plan, layout, donated, kept, trees, batch, repl, chain)
        except ValueError:
            # Arrays committed elsewhere (a new TrainState's step counter, arrays
            # made on one device) are refused by jit before it runs: if the
            # arguments' own shardings say so, place them on the mesh and go on
            # (never with arrays a call already consumed).
            if _donate.any_deleted(donated):
                raise
            placed = place_on_mesh(state, program.graph.per_replica, trees, repl)
            if placed is None:
                raise
            layout, donated, kept = _donate.split(
                placed[0], (placed[1], batch, placed[2]), donate)
            if first:
                jitted = jits[plan] = first_program(program, plan, (
                    layout, donated, kept, placed[1], batch, placed[2], chain))
                first = False
            return jitted(plan, layout, donated, kept, placed[1], batch, placed[2], chain)

    return run


def first_program(program: Program, plan: Plan, args: tuple) -> Callable:
    """A plan's first program, compiled while it is checked; returns the ``jit``
    whose cache holds it. The step's trace is the probe, whose program is the real
    one on the decisions it assumes (``Program.speculate``); it is lowered, and
    XLA compiles it in a thread (the compilation releases the GIL) while this
    thread traces the one-device reference and runs the guards
    (``Program.settle``). Their refusal is raised at once, and the compilation
    ends in the background; nothing runs before they passed (the state is
    donated). When the guards decided otherwise than the probe assumed, the
    compiled program is dropped and a new ``jit`` traces the real one."""
    speculated = jitted(program, plan)
    program.speculating = plan
    try:
        lowered = speculated.trace(plan, *args).lower()
    except BaseException:
        program.pending.pop(plan, None)
        raise
    finally:
        program.speculating = None
    compiling = _Compiling(lowered)
    try:
        kept = program.settle(plan)
    except BaseException:
        compiling.abandon()  # (a refusal is raised now, not after XLA's compilation)
        raise
    compiling.thread.join()
    if not kept:
        return jitted(program, plan)
    if compiling.error is not None:
        raise compiling.error
    return speculated


class _Compiling:
    """``lowered.compile()`` in a thread (jit's cache keeps the executable: the
    ``jit`` that traced it runs it without compiling again); :attr:`error`: what
    it raised."""

    def __init__(self, lowered: Any):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._compile, args=(lowered,),
                                       name="fleet-compile", daemon=True)
        self.thread.start()

    def _compile(self, lowered: Any) -> None:
        try:
            lowered.compile()
        except BaseException as e:  # noqa: BLE001 (raised by the calling thread)
            self.error = e

    def abandon(self) -> None:
        """The program is not wanted: its compilation ends in the background, and the
        interpreter waits for it at exit (a daemon thread still inside XLA while the
        interpreter is torn down may crash it)."""
        _join_abandoned_at_exit()
        _ABANDONED.difference_update([t for t in _ABANDONED if not t.is_alive()])
        _ABANDONED.add(self.thread)


#: compilations whose programs were refused, still running
_ABANDONED: set[threading.Thread] = set()


@functools.cache  # (registered once, at the first refusal: importing fleet registers nothing)
def _join_abandoned_at_exit() -> None:
    atexit.register(_join_abandoned)


def _join_abandoned() -> None:
    while _ABANDONED:
        _ABANDONED.pop().join()
