"""Per-example outputs scaled by the batch size: refused by name.

A step that returns the gradient of its mean loss with respect to the batch (a
saliency map, ``nnx.value_and_grad(loss_fn, argnums=(0, 1))``) or to an
intermediate (Flax's "extracting intermediates" guide: the gradients of
``nnx.capture``'s perturbations) returns, for each row, ``1 / rows`` times that
row's own gradient: ``jnp.mean``'s backward pass scales the cotangent by the
rows it averaged. Inside a fleet step those are the replica's rows, so each row
came back N times the single-device value (exactly 4 times on 4 CPU devices,
with no error, before this check).

:func:`check_row_scaled` walks each per-example output back through the
replica's trace and the single-device step's on the global batch side by side
(into calls; not into loops or branches, nor past fleet's reductions over the
replicas, whose values are global) to a scalar made of literals alone whose
value differs between the two: a constant of the batch size (``1.0 / 16.0``
where the replica has ``1.0 / 4.0``).
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal

from fleet import _compat
from fleet._errors import FleetError
from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import CALLS, PSUMS, Scope
from fleet.semantics._outputs import shard_body
from fleet.semantics._outputs_walk import Walk

_SCALED = (
    "{name} is per example (gathered in batch order) and computed from a constant of "
    "the batch size{where}: the gradient of a mean over the rows with respect to the batch "
    "or to an intermediate (a saliency map, the gradient of nnx.capture's perturbations) "
    "scales each row's gradient by 1 / the rows the mean saw, and inside a fleet step those "
    "are the replica's rows, so each row would come back {n} times the single-device value. "
    "Return each row's own gradient, jax.vmap(jax.grad(lambda row: loss(row[None])))(x), "
    "divided by the global batch size where the mean's scale is wanted "
    "(fleet.all_reduce(x.shape[0]))")


def check_row_scaled(jaxpr: Any, reference: Any, first: int, names: list[str],
                     replicas: int) -> None:
    """Refuses a per-example output of the probe (``jaxpr``'s body returns them from
    position ``first`` on, named ``names``) computed from a constant of the batch
    size, found against ``reference`` (the single-device step on the global batch,
    the same outputs at the same places); see the module docstring."""
    if reference is None or not names:
        return
    body, ref = shard_body(jaxpr), shard_body(reference)
    if len(body.outvars) != len(ref.outvars):
        return
    finder = _Finder()
    sa, sb = Scope(body), Scope(ref)
    for name, a, b in zip(names, body.outvars[first:], ref.outvars[first:]):
        eqn = finder.find(a, sa, b, sb)
        if eqn is not None:
            line = _compat.user_line(eqn)
            raise FleetError(_SCALED.format(name=name, n=replicas,
                                            where=f" ({line})" if line else ""))


class _Finder:
    """The side-by-side walk: the first equation making a scalar of literals alone
    whose value differs between the traces. A loop over a stack, not a recursion,
    and without a depth limit: a deep model's backward pass is thousands of
    equations long, and a walk that gave up there let the scaled rows through (150
    tanh layers: 4 times the single-device saliency on 4 devices, before)."""

    def __init__(self):
        self.values = Walk(1)  # (its value(): a scalar of literals alone, else None)
        self.seen: set = set()

    def find(self, a: Any, sa: Scope, b: Any, sb: Scope) -> Any:
        """The equation found from ``a`` and ``b`` (in the order a recursion would
        look: each value's inputs first to last), or None."""
        todo = [(a, sa, b, sb)]
        while todo:
            got = self._look(*todo.pop())
            if isinstance(got, list):
                todo.extend(reversed(got))
            elif got is not None:
                return got
        return None

    def _look(self, a: Any, sa: Scope, b: Any, sb: Scope) -> Any:
        """The equation found at ``a`` and ``b``, or the pairs to look at next (a list)."""
        if isinstance(a, Literal) or isinstance(b, Literal):
            return []
        key = (id(a), id(sa), id(b))
        if key in self.seen:
            return []
        self.seen.add(key)
        if id(a) in sa.inputs or id(b) in sb.inputs:
            if (id(a) not in sa.inputs or id(b) not in sb.inputs or sa.parent is None
                    or sb.parent is None):
                return []
            return [(sa.parent[0][sa.inputs[id(a)]], sa.parent[1],
                     sb.parent[0][sb.inputs[id(b)]], sb.parent[1])]
        ea, eb = sa.producer.get(id(a)), sb.producer.get(id(b))
        if (ea is None or eb is None or ea.primitive != eb.primitive
                or len(ea.invars) != len(eb.invars)
                or ea.outvars.index(a) != eb.outvars.index(b)):
            return []
        va, vb = self.values.value(a, sa), self.values.value(b, sb)
        if va is not None and vb is not None:
            return ea if va != vb else []
        name = ea.primitive.name
        if ea.params.get("name") in FLEET_CALLS or name in PSUMS:
            return []  # (a value over the replicas: the global one)
        if name in CALLS:
            ga, gb = sa.inner(ea), sb.inner(eb)
            if ga is None or gb is None:
                return []
            i = ea.outvars.index(a)
            return [(ga[1].outvars[i], ga[0], gb[1].outvars[i], gb[0])]
        if name in ("scan", "while", "cond"):
            return []
        return [(x, sa, y, sb) for x, y in zip(ea.invars, eb.invars)]
