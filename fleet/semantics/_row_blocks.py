"""Blocks of the batch's rows (``x.reshape(k, -1, ...)``: micro-batches), for the
row walk (:mod:`fleet.semantics._row_mixing`).

The single-device step's ``x.reshape(k, -1, ...)`` makes ``k`` blocks of the
global batch's consecutive rows; inside a fleet step the same line makes ``k``
blocks of the replica's own rows, and block ``i`` of the replicas together is
not the single-device step's block ``i``. A split that keeps the groups' size
(``x.reshape(-1, 2, ...)``: pairs of consecutive rows, each within one replica)
is the same on both. The replica's trace cannot tell the two apart (its shapes
are alike), so :func:`row_blocks` reads the single-device step's trace. Picking a
block (``xs[0]``, a slice of the blocks, ``jnp.split`` over them) is refused
(``fleet.semantics._row_rules.blocks_rule``); a
scan over the blocks accumulating gradients sums every block, and is exact.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend.core import jaxprs_in_params


class Blocks(NamedTuple):
    """An axis of blocks of the rows (``x.reshape(k, -1, ...)``: micro-batches),
    each of the replica's own consecutive rows, where on one device each is of the
    global batch's: picking a block is refused; anything else with it is not
    followed (a scan over the blocks accumulating gradients is exact)."""

    axis: int


def is_blocks(t: Any) -> bool:
    return isinstance(t, Blocks)


def row_blocks(reference: Any, replicas: int) -> frozenset:
    """The reshapes of the single-device step that split an axis of the global
    batch's rows in two, blocks first (``x.reshape(k, -1, ...)``: ``k`` blocks of
    consecutive rows, micro-batches), as each replica's trace has them: ``(its
    input shape, its output shape)``. A replica's ``k`` blocks are of its own
    rows, where the single-device step's are of the global batch's. A split that
    keeps the groups' size (``x.reshape(-1, 2, ...)``: pairs of consecutive rows,
    each within one replica) is not one."""
    found = set()

    def visit(jaxpr: Any) -> None:
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            for sub in jaxprs_in_params(eqn.params):
                visit(sub)
            if eqn.primitive.name != "reshape":
                continue
            old, new = eqn.invars[0].aval.shape, tuple(eqn.outvars[0].aval.shape)
            for a in range(len(old)):
                if (new[:a] == old[:a] and len(new) > a + 1 and new[a] > 1
                        and new[a] * new[a + 1] == old[a] and new[a + 1] % replicas == 0
                        and old[a] % replicas == 0):
                    local = (*old[:a], old[a] // replicas, *old[a + 1:])
                    found.add((local, (*new[:a + 1], new[a + 1] // replicas, *new[a + 2:])))
    visit(reference)
    return frozenset(found)
