"""Raw parameters' gradients used before the distributed optimizer divides them.

With no wrapped model (an optax transformation on raw parameters, the functional
style), JAX sums the parameters' gradients over the replicas (the transpose of a
replicated value used with per-replica data: N times the single-device
gradient), and ``fleet.distributed_optimizer``'s update divides them by N
(``fleet.wrappers._distributed_tx.fleet_tx_grads``). Anything the step does with
them before sees N times the single-device gradient: a clipping by hand, a
gradient norm returned, a second optimizer left plain. Before this check each
trained or reported silently away from one device (4 CPU devices: 0.094 in the
parameters after 4 steps with a hand clip; a returned ``optax.global_norm``
exactly 4 times; 0.26 in a plain second optimizer's parameters).
:func:`summed_uses` finds those uses in the probe's program.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal, jaxprs_in_params

from fleet import _compat
from fleet.comm import _sync
from fleet.semantics._gathered import PSUMS, gathered_cotangent

#: What a sum of gradients JAX made may pass through: it stays the same sum
_KEEPS_SUM = ("add_any", "convert_element_type", "copy", "copy_p", "pvary", "pcast", "reshape",
              "squeeze", "expand_dims", "transpose", "broadcast_in_dim")
_LOOPS = ("scan", "while", "cond")


def summed_uses(jaxpr: Any) -> tuple[list[str], bool]:
    """Where the step uses a gradient JAX summed over the replicas (raw parameters':
    the psums ``fleet.step._guards.foreign_psums`` counts) other than handing it to a
    distributed optimizer, which divides it by N first (``fleet_tx_grads``): the
    user's lines (else the first primitive's name), and whether the step returns
    one (:data:`RETURNED`). A call (``jit``, ``shard_map``) is followed in; a loop
    or a branch that reads one is a use, and one summed inside a loop or a branch
    is not followed."""
    found: list[str] = []
    unnamed: list[str] = []

    def walk(jaxpr: Any, marked: set) -> set:
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        users: dict[int, list] = {}
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                users.setdefault(id(v), []).append(eqn)
        for eqn in jaxpr.eqns:
            name, prim = eqn.params.get("name"), eqn.primitive.name
            reads = any(id(v) in marked for v in eqn.invars if not isinstance(v, Literal))
            if name == "fleet_tx_grads" or name in _sync.FLEET_CALLS:
                continue
            if prim in PSUMS and not gathered_cotangent(eqn, users, {id(v) for v in jaxpr.outvars}):
                marked.update(id(v) for v in eqn.outvars)
            elif prim not in _LOOPS and (subs := list(jaxprs_in_params(eqn.params))):
                inner = getattr(subs[0], "jaxpr", subs[0])
                if len(subs) == 1 and len(inner.invars) == len(eqn.invars) and len(
                        inner.outvars) == len(eqn.outvars):  # (a call: shard_map, jit, remat)
                    out = walk(inner, {id(i) for i, v in zip(inner.invars, eqn.invars)
                                       if id(v) in marked})
                    marked.update(id(o) for o, i in zip(eqn.outvars, inner.outvars)
                                  if id(i) in out)
            elif reads and prim in _KEEPS_SUM:
                marked.update(id(v) for v in eqn.outvars)
            elif reads:
                line = _compat.user_line(eqn)
                (found if line else unnamed).append(line or f"a {prim} in the step")
        return {id(v) for v in jaxpr.outvars if id(v) in marked}

    returned = walk(getattr(jaxpr, "jaxpr", jaxpr), set())
    return list(dict.fromkeys(found or unnamed[:1])), bool(returned)


RETURNED = ("the step returns gradients of raw parameters, which JAX summed over the {n} "
            "replicas; wrap the model (fleet.distributed_model) to get averaged gradients "
            "back from a step")


SUMMED_USED = (
    "the step uses the gradients of its raw parameters (no wrapped model: JAX sums "
    "them over the {n} replicas, N times the single-device gradient, and "
    "fleet.distributed_optimizer divides them by N in its update) before the "
    "distributed optimizer gets them, at {where}: there they are N times what one "
    "device computes (a clipping by hand, optax.global_norm(grads) returned, a second "
    "optimizer that is not distributed). Move the transformation into the optax chain "
    "that fleet.distributed_optimizer wraps (optax.chain(optax.clip_by_global_norm(c), "
    "...)), distribute every optimizer the step updates, or wrap the model "
    "(fleet.distributed_model), whose gradients are the mean in the whole step")
