"""A plan's compiled program: :meth:`fleet.step._program.Program.run` under ``jax.jit``.

Moved out of ``fleet.step._decorator`` (``DistributedStep._compiled``, which keeps
one :func:`jitted` per mesh and pytree layout and asks :func:`runner` for each
plan's). The NNX objects' old state is donated to the program (its leaves split
into donated and kept ones by ``fleet.step._donate``); the pytree arguments, the
batch and the replicated values are placed by ``in_shardings``, and arguments
that ``jit`` refuses because they were committed elsewhere are placed on the mesh
(``fleet.step._global_arrays.placed``) before one more try.
"""

from __future__ import annotations

from collections.abc import Callable

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


def runner(jitted: Callable, plan: Plan, program: Program, donate: bool) -> Callable:
    """The call of the plan's compiled program: ``run(state, trees, batch, repl,
    chain, flat=False)`` returns the new state, the outputs and the chain."""

    def run(state, trees, batch, repl, chain, flat=False):
        # (flat: a recalled call, whose batch and replicated values are arrays
        # and scalars, and which has no trees: fleet.step._recall)
        layout, donated, kept = (_donate.split_flat(state, batch + repl, donate) if flat
                                 else _donate.split(state, (trees, batch, repl), donate))
        try:
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
            return jitted(plan, layout, donated, kept, placed[1], batch, placed[2], chain)

    return run
