"""A summed loss the step differentiates and does not return: found among the
forward pass's unused float scalars and refused (the rules: fleet.semantics._outputs,
"A summed loss"). The forward pass alone cannot tell the loss ``jax.grad``
differentiates from a sum the step computes and leaves unused (both are values
nothing uses): the refusal says so, and how to keep an unused sum (remove it, or
return it declared)."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import Literal

from fleet import _compat
from fleet._errors import SummedLossError
from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import CALLS, Scope, is_varying_var, paired_eqns
from fleet.semantics._metrics import METRIC_CALL
from fleet.semantics._outputs import differentiable, shard_body
from fleet.semantics._outputs_walk import SUM, Walk

_UNUSED_SUM = (
    "the value computed at {where} is a sum over the batch rows of a value computed from "
    "the wrapped model's parameters, and nothing in the step uses it, as nothing uses the "
    "loss that jax.grad or nnx.grad differentiates: a loss summed over the batch "
    "(`((pred - y) ** 2).sum()`)? fleet averages the wrapped model's gradients over the "
    "{n} replicas, which is the single-device gradient of a loss that is a mean over the "
    "batch; a summed loss would train with gradients {n} times smaller than on one device. "
    "Use a mean: `.mean()`, or divide the sum by the replica's row count (x.shape[0] inside "
    "the step). If it is a sum differentiated with respect to the inputs, not the "
    "parameters (a gradient penalty's jax.grad(lambda x: model(x).sum())(x)), take each "
    "row's gradient instead: jax.vmap(jax.grad(lambda row: model(row[None]).sum()))(x). If "
    "the step does not differentiate it (a value computed and left unused), remove it, or "
    "return it and declare it: out_reduce='sum' at its position")


def _unused_scalars(jaxpr: Any, ref: Any, sa: Scope, sb: Scope) -> list:
    """Pairs ``(a, sa, b, sb, eqn)``: each float scalar, varying, that an equation
    of ``jaxpr`` makes and nothing uses (not an equation's input but a metric's
    update, fleet.semantics._metrics's marked call; not an output),
    beside its place in ``ref``; into calls and ``scan`` bodies too. The two
    traces' equations are paired where their sequences of primitives match
    (ZeRO stage 3's one-device reference splits and gathers with equations of its
    own); the rest is left out."""
    jaxpr, ref = getattr(jaxpr, "jaxpr", jaxpr), getattr(ref, "jaxpr", ref)
    used = {id(v) for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)
            and not str(e.params.get("name", "")).startswith(METRIC_CALL)}
    used.update(id(v) for v in jaxpr.outvars if not isinstance(v, Literal))
    found = []
    for ea, eb in paired_eqns(jaxpr.eqns, ref.eqns):
        if ea.primitive != eb.primitive or len(ea.outvars) != len(eb.outvars):
            continue
        if ea.params.get("name") in (*FLEET_CALLS, "fleet_declared"):
            continue
        for a, b in zip(ea.outvars, eb.outvars):
            if (id(a) not in used and a.aval.shape == () and is_varying_var(a)
                    and np.issubdtype(a.aval.dtype, np.inexact)):
                found.append((a, sa, b, sb, ea))
        if ea.primitive.name == "scan":
            inner = [Scope(e.params["jaxpr"], (e.invars, s)) for e, s in ((ea, sa), (eb, sb))]
            found += _unused_scalars(ea.params["jaxpr"], eb.params["jaxpr"], *inner)
        elif ea.primitive.name in CALLS:
            ga, gb = sa.inner(ea), sb.inner(eb)
            if ga is not None and gb is not None:
                found += _unused_scalars(ga[1], gb[1], ga[0], gb[0])
    return found


def check_summed_loss(jaxpr: Any, reference: Any, replicas: int) -> None:
    """Refuses a loss the step differentiates without using it otherwise, when it is
    a sum over the batch rows of a value computed from the wrapped model's synced
    parameters (see the module docstring). ``reference``: the same step on one
    device with the global batch (``replicas`` times the rows), or None."""
    if reference is None or replicas == 1:
        return
    body, ref = shard_body(jaxpr), shard_body(reference)
    sa, sb = Scope(body), Scope(ref)
    tainted = None
    for a, sa_, b, sb_, eqn in _unused_scalars(body, ref, sa, sb):
        walk = Walk(replicas, summed_loss=True)
        if walk.kind(a, sa_, b, sb_) != ("k", SUM):
            continue
        tainted = differentiable(body) if tainted is None else tainted
        if id(a) in tainted:
            where = _compat.user_line(eqn) or "a line of the step"
            raise SummedLossError(_UNUSED_SUM.format(where=where, n=replicas))
