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
(``fleet.semantics._row_rules.blocks_rule``), and so is a scan over the blocks
that carries into its next iteration what it reduced over the replicas from a
block (:class:`BlockScans`: an optimizer update per micro-batch, 0.17 in the
parameters after 3 SGD steps on 4 CPU devices before this check; a decayed sum
of the gradients, 0.16). A scan over the blocks summing their gradients,
updating once after it, sums every block, and is exact.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend.core import Literal, jaxprs_in_params

from fleet.semantics._jaxpr_scope import holds_reduction


class Blocks(NamedTuple):
    """An axis of blocks of the rows (``x.reshape(k, -1, ...)``: micro-batches),
    each of the replica's own consecutive rows, where on one device each is of the
    global batch's: picking a block is refused; anything else with it is not
    followed (a scan over the blocks accumulating gradients is exact)."""

    axis: int


def is_blocks(t: Any) -> bool:
    return isinstance(t, Blocks)


UPDATED_PER_BLOCK = (
    "a scan over blocks of the rows (x.reshape(k, -1, ...): micro-batches) that carries "
    "into its next iteration what it reduced over the replicas from a block, other than "
    "summed into an accumulator (an optimizer update per micro-batch, a decayed sum of the "
    "gradients): each replica's block i is of its own rows, the single-device step's of the "
    "global batch's, so each iteration would see other rows; take every k-th row instead, "
    "x.reshape(-1, k, ...).swapaxes(0, 1), whose block i is the same rows on one device and "
    "on the replicas together, or sum the gradients over the scan and update once after it")


class BlockScans:
    """The scans over blocks of the rows the walk is in, and what their bodies
    compute from a block: where one carries into its next iteration what it
    reduced over the replicas from a block, other than summed into an
    accumulator (``acc + grads``, a carry read only by that sum), it updates per
    block, where each replica's block is not the single-device step's."""

    def __init__(self):
        #: id(var) -> (the scan's refusal, whether reduced over the replicas)
        self.marks: dict = {}

    def enter(self, eqn: Any, ins: list, scanned_at: int, calls: list) -> None:
        """A scan ``eqn`` with input tags ``ins`` (scanned from ``scanned_at``):
        its body's variables that hold one block each iteration are marked."""
        invars = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]).invars
        for v, t in zip(invars[scanned_at:], ins[scanned_at:]):
            if is_blocks(t) and t.axis == 0:
                self.marks[id(v)] = ((eqn, UPDATED_PER_BLOCK, calls), False)

    def follow(self, eqn: Any) -> None:
        """Passes the marks of ``eqn``'s inputs on to its outputs, as reduced where
        an input was or ``eqn`` reduces over the replicas."""
        if not self.marks:
            return
        found = [self.marks[id(v)] for v in eqn.invars
                 if not isinstance(v, Literal) and id(v) in self.marks]
        if found:
            mark = (found[0][0], any(r for _, r in found) or holds_reduction(eqn))
            for v in eqn.outvars:
                self.marks[id(v)] = mark

    def carried(self, body: Any, carries: range) -> tuple | None:
        """The refusal of a scan whose ``body`` (its carries at ``carries``) updates
        per block, else None."""
        inner = getattr(body, "jaxpr", body)
        for j in carries:
            old, new = inner.invars[j], inner.outvars[j - carries.start]
            mark = None if isinstance(new, Literal) else self.marks.get(id(new))
            if mark is None or not mark[1]:
                continue
            readers = [e for e in inner.eqns if any(v is old for v in e.invars)]
            if not readers or any(e.primitive.name not in ("add", "add_any")
                                  or e.outvars[0] is not new for e in readers):
                return mark[0]
        return None


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
