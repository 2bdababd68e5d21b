"""``fleet.all_gather``'s gradient in a step (:mod:`fleet.step._guards`,
:mod:`fleet.step._probe_checks`).

A contrastive loss's data-parallel form compares each replica's own rows with
every replica's, gathered (``za @ fleet.all_gather(zb).reshape(-1, d).T``). The
gathered value is the same on every replica; used with the replica's rows, JAX
casts it to per-replica, and the transpose of that cast sums its cotangent over
the replicas: each replica's rows then get every replica's share, which fleet's
average of the gradients turns into the single-device gradient. That sum is the
global computation's, not a psum of the user's (:func:`gathered_cotangent`).

A loss of the gathered rows alone (``fleet.all_gather(per_row).mean()``) is the
same on every replica: no such sum, and each replica's rows get 1/N of their
gradient (:func:`gathered_alone`). fleet follows the cotangent from the sum to the
gather's transpose through layout changes and constant scales only; anything else
is refused (:data:`GATHERED_ALONE`), a nonlinear term of the gathered rows too,
though it is exact.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal, jaxprs_in_params

from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import PSUMS, is_varying_var

_SCALED = ("mul", "div", "neg")
#: Operations a cotangent passes on its way to ``fleet.all_gather``'s transpose.
_LINEAR_LAYOUT = frozenset(("transpose", "reshape", "squeeze", "expand_dims", "add_any",
                            "convert_element_type", "copy"))

GATHERED_ALONE = (
    "the step differentiates fleet.all_gather's result other than where each replica's own "
    "rows meet it directly: a loss of the gathered rows alone (fleet.all_gather(per_row)"
    ".mean(), the same on every replica, whose gradient would reach each replica's rows as "
    "1/{n} of the single-device one), or a term of them that fleet cannot follow to each "
    "replica's share (a nonlinear function of the gathered rows). Compute such a loss from "
    "the replica's own rows (fleet averages it over the replicas); fleet.all_gather trains "
    "as on one device where the replica's rows meet the gathered ones in a product (a "
    "contrastive loss: its own embeddings times every replica's, za @ gathered.T)")


def gathered_alone(jaxpr: Any) -> bool:
    """Whether a cotangent reaches ``fleet.all_gather``'s transpose (the call with
    an input the same on every replica and a per-replica output) other than through
    JAX's sum over the replicas (:func:`gathered_cotangent`): the gathered value was
    used alone, not with each replica's rows, and that gradient would be N times too
    small (:data:`GATHERED_ALONE`)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    made = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == "fleet_all_gather" and _is_transpose(eqn):
            todo, seen = list(eqn.invars), set()
            while todo:
                v = todo.pop()
                if id(v) in seen:
                    continue
                seen.add(id(v))
                src = made.get(id(v))
                if src is None or not (src.primitive.name in PSUMS or _passes_cotangent(src)):
                    return True  # (from an input of this jaxpr, or a non-linear op: alone)
                if src.primitive.name not in PSUMS:
                    todo.extend(v for v in src.invars if not isinstance(v, Literal))
        if eqn.params.get("name") not in FLEET_CALLS and any(
                gathered_alone(sub) for sub in jaxprs_in_params(eqn.params)):
            return True
    return False


def _passes_cotangent(eqn: Any) -> bool:
    """A layout change, a sum of cotangents, or a constant scale (a temperature)."""
    name = eqn.primitive.name
    return name in _LINEAR_LAYOUT or (
        name in _SCALED and sum(not isinstance(v, Literal) for v in eqn.invars) == 1)


def _is_transpose(eqn: Any) -> bool:
    return not any(map(is_varying_var, eqn.invars)) and all(map(is_varying_var, eqn.outvars))


def gathered_cotangent(eqn: Any, users: dict, outs: set) -> bool:
    """Whether ``eqn`` (a psum) sums the cotangent of ``fleet.all_gather``'s value:
    JAX's transpose of using that value (the same on every replica) with each
    replica's rows, whose every use, through layout changes and sums, is the
    gather's own transpose. The global computation's gradient needs that sum
    (a contrastive loss against every replica's rows)."""
    seen, todo = set(), list(eqn.outvars)
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if id(v) in outs or not users.get(id(v)):
            return False
        for user in users[id(v)]:
            if user.params.get("name") == "fleet_all_gather" and _is_transpose(user):
                continue
            if not _passes_cotangent(user):
                return False
            todo.extend(user.outvars)
    return True


