"""The control flow of :mod:`fleet.semantics._row_mixing`'s walk: a ``scan``'s body
(``nnx.scan`` over layers, a loop over micro-batches), each branch of a
``cond``, a ``while_loop``'s condition and body. Each is walked with its inputs'
tags, a loop's carries again until their tags hold (else the loop's outputs are
not followed), and what was mixed or decided inside leaves it so
(:meth:`ControlFlow.mixed_out`).
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal

from fleet import _compat
from fleet.semantics._row_tags import PARTIAL, UNKNOWN, is_row, stacked, unstacked


class ControlFlow:
    """The walk's rules for ``scan``, ``cond`` and ``while`` (mixed into
    ``fleet.semantics._row_mixing._Rows``, whose ``walk``, ``calls``, ``refuse``,
    ``block_scans``, ``mixed`` and ``decided`` they use)."""

    def scan(self, eqn: Any, ins: list) -> list:
        """A ``scan`` (``nnx.scan`` over layers, a loop over micro-batches): its body
        walked with its constants' and carries' tags and its scanned inputs' one
        axis in, the carries walked again until their tags hold; its stacked
        outputs get that axis back. A loop over the rows themselves (``jax.lax.map``
        over the batch) is not followed."""
        consts, carries = _compat.scan_counts(eqn.params)
        body = eqn.params["jaxpr"]
        xs = [unstacked(t) for t in ins[consts + carries:]]
        carry = list(ins[consts:consts + carries])
        self.block_scans.enter(eqn, ins, consts + carries, list(self.calls))
        held, carry, outs = self.settled(
            eqn, carry, lambda c: self.walk(body, [*ins[:consts], *c, *xs]))
        if (refusal := self.block_scans.carried(body, range(consts, consts + carries))):
            self.refuse(*refusal)
        self.mixed_out(body, eqn)
        if not held:  # (the carries' tags did not hold)
            return [UNKNOWN] * len(eqn.outvars)
        return [*carry, *(stacked(t) for t in outs[carries:])]

    def settled(self, eqn: Any, carry: list, once: Any) -> tuple[bool, list, list]:
        """A loop's body walked (``once(carry)``: its outputs' tags, the carries
        first) until its carries' tags hold, each that changes taken as unknown:
        whether they held, the carries' tags, the last walk's outputs."""
        held, outs = False, []
        self.calls.append(eqn)
        try:
            for _ in range(3):
                outs = once(carry)
                settled = [a if a == b else UNKNOWN for a, b in zip(carry, outs)]
                held = settled == carry
                if held:
                    break
                carry = settled
        finally:
            self.calls.pop()
        return held, carry, outs

    def branches(self, eqn: Any, ins: list) -> list:
        """A ``cond`` (``jax.lax.cond``, ``nnx.cond``: mixup applied with some
        probability, a loss term switched on after a step): each branch walked with
        the operands' tags; an output keeps the branches' tag where they agree.
        Decided on a value of the replica's rows, the outputs are its own."""
        outs = []
        self.calls.append(eqn)
        try:
            for branch in eqn.params["branches"]:
                outs.append(self.walk(branch, ins[1:]))
                self.mixed_out(branch, eqn)
        finally:
            self.calls.pop()
        joined = [t[0] if len(set(t)) == 1 else UNKNOWN if any(map(is_row, t)) else PARTIAL
                  for t in zip(*outs)]
        return [PARTIAL if ins[0] is not None and t is None else t for t in joined]

    def mixed_out(self, inner: Any, eqn: Any) -> None:
        """A value mixed (or decided) inside a call's or a loop's body leaves it so."""
        for v, w in zip(getattr(inner, "jaxpr", inner).outvars, eqn.outvars):
            for marks in (self.mixed, self.decided):
                if not isinstance(v, Literal) and id(v) in marks:
                    marks.setdefault(id(w), marks[id(v)])

    def loop(self, eqn: Any, ins: list) -> list:
        """A ``while_loop`` (``jax.lax.fori_loop`` with a traced bound, an iteration
        until convergence): its condition and body walked with the constants' and
        carries' tags, the carries again until their tags hold. A loop whose
        condition reads a value of the replica's rows runs its own number of
        times: its outputs are the replica's own."""
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        decided = []

        def once(carry: list) -> list:
            decided.append(self.walk(p["cond_jaxpr"], [*ins[:nc], *carry])[0] is not None)
            return self.walk(p["body_jaxpr"], [*ins[nc:nc + nb], *carry])

        held, carry, _ = self.settled(eqn, list(ins[nc + nb:]), once)
        decided = decided[-1]
        self.mixed_out(p["body_jaxpr"], eqn)
        if not held:
            return [UNKNOWN] * len(eqn.outvars)
        return [PARTIAL if decided and t is None else t for t in carry]
