"""How a per-replica scalar output combines over the replicas, read from the traced step.

A step returns scalars computed from its replica's rows: a loss ``.mean()``, a
``jnp.max(logits)``, a count ``(pred == y).sum()``. Each replica's value is a
*partial* result; the single-device value is its mean, sum, maximum or minimum
over the replicas, depending on the reduction that made it. fleet reads that
reduction from the step's jaxpr, once per compiled plan (at the probe, never
per call):

* each undeclared scalar output is followed back through the body's jaxpr
  (into ``jit``, ``custom_jvp`` / ``custom_vjp`` calls and ``remat``) to the
  reduction over the batch rows that made it: ``reduce_sum`` is a *sum*,
  ``reduce_max`` / ``reduce_or`` a *max*, ``reduce_min`` / ``reduce_and`` a *min*;
* a sum divided by a count of the replica's rows (``jnp.mean``'s divisor,
  ``x.shape[0]``) is a *mean*; divided by a constant (a hard-coded number, a
  replicated argument) it stays a *sum*;
* a ``scan``'s carry (a loss accumulated over micro-batches) has the kind the
  loop leaves it: its initial value's, then one iteration's, to a fixed point
  (``0.0`` plus a mean per iteration is a mean);
* the ops between keep the kind where that is exact: a dtype cast (to a float
  dtype, for a mean or sum), a negation (a max becomes a min), adding a constant
  (not to a sum; a constant is also a value typed varying but the same on every
  replica, computed alike in both traces: an L2 term of the parameters read as
  ``variable[...]``), a multiplication or division by a constant (for a max or
  min, by a literal of known sign), the sum or difference of two means (or two sums);
* anything else (a standard deviation, a ``sqrt`` of a mean, a ratio of two
  sums, a product of two means, a value stacked by a ``scan``) has no combination
  that gives the single-device value: the step is refused, naming the output.

*Rows versus constants*: a divisor is told from a constant by tracing the step a
second time, on one device, with more rows (the global batch; with one replica,
twice its rows): a count of rows grows with them, a constant does not. The two
traces are walked side by side; where their structure differs the output is not
classified (refused). A reduction is over the batch rows when the reduced
operand's leading axis, and only it, grows with the rows.

*A summed loss*: fleet averages the wrapped model's gradients over the replicas,
which is the single-device gradient when the differentiated value is a mean over
the rows. A *sum* output that is a differentiable function of the wrapped
model's synced parameters (its reduced operand depends on them through float
ops) is refused as a summed loss. So is one the step differentiates and does
not return (``nnx.grad`` alone, ``has_aux``):
:func:`fleet.semantics._summed_loss.check_summed_loss`
classifies every float scalar of the forward pass that nothing in the step uses
-- the value ``jax.grad`` differentiated -- the same way (a sum plus any
constant counts as a sum: its gradient is the sum's), and refuses a sum, naming
its line; the two traces' equations are paired where they run alike (micro-batches
of one row per replica, stage 3's one-device reference). Not caught: a summed
loss returned under an explicit ``out_reduce`` (the declaration is trusted).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params

from fleet._errors import FleetError, SummedLossError
from fleet.comm._sync import FLEET_CALLS
from fleet.comm._synced import raw_read_hint
from fleet.runtime._world import current_strategy
from fleet.sections import _stage3
from fleet.semantics._jaxpr_scope import (
    ReplicaConstant,
    Scope,
    is_sync,
    is_varying_var,
    refuse_custom_vjp3,
)
from fleet.semantics._outputs_walk import MEAN, SUM, Walk

_CANNOT = (
    "{name} (a {dtype} that differs across replicas) is not a mean, a "
    "sum, a maximum or a minimum over the batch rows ({why}), so no combination of "
    "the replicas' values gives the single-device value. Return the parts as sums "
    "(e.g. the sum and the sum of squares, or the numerator and the count) and "
    "combine them after the step, return the per-example values (gathered in batch "
    "order) and reduce them after the step, or declare how it combines: "
    "fleet.distributed_step(fn, out_reduce=...) with 'mean', 'sum', 'max' or 'min' at "
    "its position")
_STAGE3 = ". " + raw_read_hint("this output")


def _cannot(name: str, dtype: Any, why: str, shape: tuple = ()) -> FleetError:
    """The error for an output no combination gives; under stage 3 it says where a
    value differing across replicas may come from besides the batch."""
    hint = _STAGE3 if _stage3.active(current_strategy()) else ""
    what = f"{dtype} scalar" if not shape else f"{dtype} array of shape {shape}"
    return FleetError(_CANNOT.format(name=name, dtype=what, why=why) + hint)


_SUMMED_LOSS = (
    "{name} is a sum over the batch rows of a value computed from the wrapped "
    "model's parameters: a loss summed over the batch (`((pred - y) ** 2).sum()`)? "
    "fleet averages the wrapped model's gradients over the {n} replica(s), which is "
    "the single-device gradient of a loss that is a mean over the batch; a summed "
    "loss would train with gradients {n} times smaller than on one device. Use a "
    "mean: `.mean()`, or divide the sum by the replica's row count (x.shape[0] inside "
    "the step). If this output is a metric that the step does not differentiate, "
    "declare it: out_reduce='sum' at its position")


def shard_body(jaxpr: Any) -> Any:
    """The per-replica body of a traced step (its ``shard_map``'s jaxpr)."""
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map")
    return eqn.params["jaxpr"]


def differentiable(body: Any) -> set:
    """Ids of the variables, in the body and the jaxprs it calls, that are float
    functions of the wrapped model's synced parameters (the outputs of fleet's sync
    calls, :func:`is_sync`) in the forward pass: the dependence ends at fleet's
    collectives, so values computed from the updated parameters (through the
    averaged gradients) are not in it.
    (An inner jaxpr can be shared by several calls: each call is walked with its
    own set.)"""

    refuse_custom_vjp3()  # (its traces hide fleet's sync calls)

    def inexact(v):
        return np.issubdtype(v.aval.dtype, np.inexact)

    everywhere: set = set()  # (the inner jaxprs' too: fleet.semantics._outputs.check_summed_loss)

    def walk(jaxpr: Any, seeds: set) -> set:
        tainted = set(seeds)
        for eqn in jaxpr.eqns:
            if is_sync(eqn):
                tainted.update(id(v) for v in eqn.outvars)
                continue
            if eqn.params.get("name") in FLEET_CALLS:  # the synced gradients: not the forward
                continue
            hit = [not isinstance(v, Literal) and id(v) in tainted for v in eqn.invars]
            subs = [getattr(p, "jaxpr", p) for p in eqn.params.values()
                    if hasattr(getattr(p, "jaxpr", p), "eqns")]
            for inner in subs:
                aligned = len(inner.invars) == len(eqn.invars)
                inside = walk(inner, {id(s) for s, h in zip(inner.invars, hit) if h}
                              if aligned else ({id(s) for s in inner.invars} if any(hit)
                                               else set()))
                if len(inner.outvars) == len(eqn.outvars):
                    tainted.update(id(o) for o, s in zip(eqn.outvars, inner.outvars)
                                   if id(s) in inside and inexact(o))
                elif any(id(s) in inside for s in inner.outvars):
                    tainted.update(id(o) for o in eqn.outvars if inexact(o))
            if any(hit) and not subs:
                tainted.update(id(o) for o in eqn.outvars if inexact(o))
        everywhere.update(tainted)
        return tainted

    walk(getattr(body, "jaxpr", body), set())
    return everywhere


def scalar_reduces(jaxpr: Any, reference: Any, scale: int, names: list[str],
                   dtypes: list, replicas: int, wrapped: bool) -> list[str]:
    """How each undeclared scalar output that differs across replicas combines:
    ``mean``, ``sum``, ``max`` or ``min`` (see the module docstring). ``jaxpr``:
    the probe (the body returns those outputs, in order); ``reference``: the same
    body traced with ``scale`` times the rows on one device, or None (one replica,
    where any combination is the value itself: today's rule). Raises a FleetError
    for an output it cannot combine, or a summed loss (``wrapped``: the step
    differentiates a wrapped model)."""
    default = [MEAN if np.issubdtype(d, np.inexact) else SUM for d in dtypes]
    if not names:
        return []
    if reference is None:
        return default
    body, ref = shard_body(jaxpr), shard_body(reference)
    if len(body.outvars) != len(ref.outvars):
        raise _cannot(names[0], dtypes[0], "the step returns other outputs for other batch "
                                           "sizes")
    sa, sb = Scope(body), Scope(ref)
    tainted = None
    out = []
    for name, dtype, a, b in zip(names, dtypes, body.outvars, ref.outvars):
        walk = Walk(scale, replicas=replicas)
        got = walk.kind(a, sa, b, sb)
        if got is None or got[0] != "k":
            why = walk.why if got is None else "a count of rows, not a value from them"
            raise _cannot(name, dtype, why, tuple(a.aval.shape[1:]))  # (the probe's (1, ...))
        if got[1] == SUM and wrapped and np.issubdtype(dtype, np.inexact):
            tainted = differentiable(body) if tainted is None else tainted
            if id(a) in tainted:
                raise SummedLossError(_SUMMED_LOSS.format(name=name, n=replicas))
        out.append(got[1])
    return out


@jax.jit
def fleet_declared(*leaves: Any) -> tuple:
    """The identity, as a call the probe makes on the outputs declared by
    ``out_reduce``: the declaration is the user's, so such an output is used, never
    taken for a differentiated loss (:func:`check_summed_loss`)."""
    return leaves


_COUNTED = (
    "{name} leaves the step the same on every replica, but it is computed from the "
    "batch's shape (x.shape[0] inside the step is the replica's rows, not the global "
    "batch's): each replica would count its own rows, unlike one device. Count with "
    "fleet.all_reduce(x.shape[0]) (the global rows), or keep counts in an nnx.metrics "
    "metric, which fleet updates with the global batch")


_GATHERED = (
    "{name} leaves the step the same on every replica, but it holds rows gathered with "
    "fleet.all_gather that are not each row's own value, computed from that row alone (a "
    "statistic of the replica's rows, a sort or a slice of them, random bits drawn per "
    "replica): gathered, they are not the single-device step's rows. Gather each row's own "
    "value (a MoCo queue: fleet.all_gather(keys).reshape(-1, d) of keys computed row by "
    "row), and take statistics of the batch with fleet.all_reduce")


def check_counted(jaxpr: Any, reference: Any, first: int, names: list[str]) -> None:
    """Refuses state the step leaves the same on every replica whose value is
    computed otherwise for other batch sizes (a count of the replica's rows):
    ``jaxpr``'s body returns those leaves from position ``first`` on, and so does
    ``reference`` (the step on one device with the global batch); values from
    fleet's reductions over the replicas count as the same global value. A
    ``scan``'s carry is compared through its update (a count of the micro-batch's
    rows added each iteration is refused; an ``nnx.scan``'s RNG count is the
    same); a value that comes out of a ``while`` loop or a branch is taken as the
    same, so the check never refuses on its account (a count made there is not
    caught)."""
    if reference is None or not names:
        return
    body, ref = shard_body(jaxpr), shard_body(reference)
    sa, sb = Scope(body), Scope(ref)
    walk = Walk(1)
    walk.global_calls = (*FLEET_CALLS, "fleet_gather")
    for name, a, b in zip(names, body.outvars[first:], ref.outvars[first:]):
        if not walk.same(a, sa, b, sb):
            raise FleetError((_GATHERED if walk.gathered_unlike else _COUNTED).format(name=name))


def check_written(jaxpr: Any, refusals: list[str]) -> None:
    """Refuses a value the step keeps as replica 0's (a parameter a wrapped
    model's call wrote, state set under no_sync: ``refusals``, each one's error,
    in the order of the probe's ``fleet_written`` calls) where it may differ
    across replicas: replica 0's value is right only where every replica
    computed the same (fleet.semantics._jaxpr_scope.ReplicaConstant; inside a
    loop or a branch it is not followed, and refused)."""
    constant = ReplicaConstant()
    # (a call takes one varying value and gives it invariant; where the step
    # differentiates through a kept value, a kernel written by one call of the model
    # and read by the next, the transposed call gives the gradient back varying)
    calls = [(eqn, scope) for eqn, scope in _named_calls(jaxpr, {"fleet_written"})
             if not is_varying_var(eqn.outvars[0])]
    if len(calls) != len(refusals):  # (not met: then any value kept is refused alike)
        refusals = [refusals[0]] * len(calls)
    for refusal, (eqn, scope) in zip(refusals, calls):
        if not constant(eqn.invars[0], scope):
            raise FleetError(refusal)


_METRIC = (
    "the step updates metric {label} with a {dtype}scalar that differs across replicas "
    "and is not a mean, a sum, a maximum or a minimum over the batch rows ({why}), so no "
    "combination of the replicas' values gives the value the metric gets on one device. "
    "Pass per-example values (leading axis = the replica's rows: per-example losses, "
    "errors, a mask), which fleet gathers from every replica in batch order, or combine "
    "the parts over the replicas yourself before the update: fleet.all_reduce(value, "
    "'sum') for a sum, 'avg' for a mean, 'max' or 'min' (e.g. a standard deviation from "
    "the all-reduced sums of x and x ** 2)")


def _marked_calls(jaxpr: Any, names: set) -> dict:
    """The first call of each name in ``names`` in a traced step's body:
    name -> (equation, its scope) (:func:`_named_calls`)."""
    found: dict = {}
    for eqn, scope in _named_calls(jaxpr, names):
        found.setdefault(eqn.params["name"], (eqn, scope))
    return found


def _named_calls(jaxpr: Any, names: set) -> list:
    """The calls named in ``names`` in a traced step's body, at any depth, in
    order: (equation, its scope). Inside a call whose jaxpr is the call's own (a
    ``jit``) the walk can follow values out; inside another (a ``scan``'s body)
    it cannot."""
    found: list = []

    def visit(scope: Scope, inner: Any) -> None:
        for eqn in inner.eqns:
            if eqn.params.get("name") in names:
                found.append((eqn, scope))
                continue
            sub = scope.inner(eqn)
            if sub is not None:
                visit(*sub)
                continue
            for other in jaxprs_in_params(eqn.params):
                visit(Scope(other), getattr(other, "jaxpr", other))

    body = shard_body(jaxpr)
    visit(Scope(body), getattr(body, "jaxpr", body))
    return found


def metric_reduces(jaxpr: Any, reference: Any, scale: int, calls: list[str],
                   labels: list[str], replicas: int) -> list[str]:
    """How each varying scalar a metric's update got combines over the replicas
    (fleet.semantics._metrics): ``mean``, ``sum``, ``max`` or ``min``, read as for a scalar
    output (the module docstring) from its operand in ``calls[k]``, the probe's
    k-th marked call, and the same call in ``reference`` (``scale`` times the
    rows, one device), or None (any combination is the value: float mean,
    else sum). Raises a FleetError naming the metric, ``labels[k]``, for a
    scalar it cannot combine."""
    if not calls:
        return []
    mine = _marked_calls(jaxpr, set(calls))
    theirs = _marked_calls(reference, set(calls)) if reference is not None else {}
    out = []
    for call, label in zip(calls, labels):
        if call not in mine:
            raise FleetError(_METRIC.format(label=label, dtype="", why=(
                "fleet cannot follow it in the traced step")))
        ea, sa = mine[call]
        a = ea.invars[0]
        dtype = f"{a.aval.dtype} "
        if reference is None:
            out.append(MEAN if np.issubdtype(a.aval.dtype, np.inexact) else SUM)
            continue
        if call not in theirs:
            raise FleetError(_METRIC.format(label=label, dtype=dtype, why=(
                "the step updates its metrics otherwise for other batch sizes")))
        eb, sb = theirs[call]
        walk = Walk(scale, replicas=replicas)
        got = walk.kind(a, sa, eb.invars[0], sb)
        if got is None or got[0] != "k":
            why = walk.why if got is None else "a count of rows, not a value from them"
            raise FleetError(_METRIC.format(label=label, dtype=dtype, why=why))
        if got[1] == MEAN and not np.issubdtype(a.aval.dtype, np.inexact):
            raise FleetError(_METRIC.format(label=label, dtype=dtype, why=(
                "an integer sum divided by a count of rows, rounded")))
        out.append(got[1])
    return out
