"""Guards: the checks that turn silent divergence and hangs into named errors.

* :func:`foreign_psums` / :func:`summed_state`: a gradient that JAX summed over
  replicas (state that no wrapped model synced) is found in the traced program;
  :func:`all_reduced_casts` names the commonest cause with a wrapped model: a
  differentiated value of ``fleet.all_reduce`` added to a replica's own;
* :func:`check_on_one_device`: the step traced once as the single-device step
  on the global shapes, so its shape errors are raised with those shapes;
* :func:`agree_program` / :func:`agree_replicated`: the processes compare what
  they traced and the scalars they pass, through a bounded key-value exchange
  (the first also carries each process's batch fingerprint: ``fleet.step._rows``).

``strategy.check_nan_inf`` is ``fleet.sections._finite``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params
from jax.sharding import PartitionSpec as P

from fleet import _compat
from fleet._errors import FleetError, nth
from fleet.comm import _sync
from fleet.runtime._agree import agree
from fleet.runtime._leaves import dotted
from fleet.runtime._world import DATA_AXIS
from fleet.semantics import _trace_errors
from fleet.semantics._gathered import PSUMS, gathered_cotangent
from fleet.semantics._jaxpr_scope import Scope, uses_all_reduce
from fleet.step import _hints, _rows
from fleet.step._roles import REPL, TREE


def foreign_psums(jaxpr: Any) -> int:
    """psums in ``jaxpr`` outside fleet's own collectives (``_sync.FLEET_CALLS``),
    but for the sum of ``fleet.all_gather``'s cotangent (``_gathered.gathered_cotangent``)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    users: dict[int, list] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            users.setdefault(id(v), []).append(eqn)
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") in _sync.FLEET_CALLS:
            continue
        if eqn.primitive.name in PSUMS and not gathered_cotangent(
                eqn, users, {id(v) for v in jaxpr.outvars}):
            total += len(eqn.invars)
        for sub in jaxprs_in_params(eqn.params):
            total += foreign_psums(sub)
    return total


def placeholder_uses(jaxpr: Any) -> list[str]:
    """What reads the gradient placeholders of a sharded step (the outputs of
    ``fleet_shard_grad``): the primitives that take them, or ``"the step's
    output"``. A ``jit`` that returns them passes the mark on to its outputs."""
    found: list[str] = []

    def walk(jaxpr: Any, marked: set, top: bool = False) -> set:
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        for eqn in jaxpr.eqns:
            if eqn.params.get("name") == "fleet_mark":  # (the probe's marks: fleet.semantics._random)
                continue
            if eqn.params.get("name") == "fleet_shard_grad":
                marked.update(id(v) for v in eqn.outvars)
                continue
            reads = [i for i, v in enumerate(eqn.invars) if id(v) in marked]
            subs = list(jaxprs_in_params(eqn.params))
            if reads:
                found.append(eqn.params.get("name") or eqn.primitive.name)
            for sub in subs:
                inner = walk(sub, set())
                outs = getattr(sub, "jaxpr", sub).outvars
                if len(subs) == 1 and len(outs) == len(eqn.outvars):
                    marked.update(id(o) for o, i in zip(eqn.outvars, outs) if id(i) in inner)
        if top:
            found.extend("the step's output" for v in jaxpr.outvars if id(v) in marked)
        return marked

    walk(jaxpr, set(), top=True)
    return found


def implicit_sum(n: int, summed: list[str], wrapped: bool, unsynced: Sequence[str] = ()) -> str:
    """The message for a step whose program sums over replicas outside fleet: the
    state leaves whose gradients JAX summed (``summed``), whether the step has a
    wrapped model (``wrapped``), and which of them are parameters no wrapping
    synced (``unsynced``: a layer added after the wrapping, a model never
    wrapped)."""
    if not summed:
        return (
            f"the step sums over the {n} replicas itself (a jax.lax.psum or pmean of its "
            "own): fleet already averages the loss, the metrics and the wrapped model's "
            "gradients over the replicas, so remove it; to combine a value of your own "
            "across replicas, use fleet.all_reduce")
    what = ", ".join(summed[:3]) + (" ..." if len(summed) > 3 else "")
    if wrapped and unsynced:
        what = ", ".join(unsynced[:3]) + (" ..." if len(unsynced) > 3 else "")
        return (
            f"the step differentiates {what}, parameters that fleet.distributed_model did "
            "not wrap: a layer added to the model after it was wrapped, or a second model "
            f"that never was. JAX sums such gradients over the {n} replicas (N times the "
            "single-device gradient) instead of averaging them. Build the whole model "
            "before `model = fleet.distributed_model(model)`, and wrap every model whose "
            "parameters the step trains")
    if wrapped:
        return (
            f"the step differentiates {what} through a read outside the wrapped model's "
            "call (an L2 penalty computed from the parameters inside the loss, say): JAX "
            f"sums such gradients over the {n} replicas (N times the single-device "
            "gradient) instead of averaging them. Compute such a term inside the model's "
            "__call__ or, with an NNX model, from the parameters read as variable[...] "
            "(fleet averages such reads' gradients too); for weight decay add "
            "optax.add_decayed_weights(...) to the optax chain")
    return (
        f"the step differentiates {what}, which is not a wrapped model's parameter: JAX "
        f"sums such gradients over the {n} replicas (N times the single-device gradient) "
        "instead of averaging them. Wrap the model: `model = fleet.distributed_model("
        "model)` (NNX: compute the loss by calling the wrapped model; Linen: use the "
        "wrapped model's `apply`, e.g. TrainState.create(apply_fn=model.apply, ...))")


def check_closures(fn: Any) -> None:
    """Refuses a step that closes over a ``jax.Array`` split over devices (a batch
    placed by fleet.io, say): inside the step every replica would see the whole
    array, not its own rows. Names the variable and says to pass it in."""
    for name, value, closed in _hints.outside_values(fn):
        if closed and isinstance(value, jax.Array) and not value.sharding.is_fully_replicated:
            raise FleetError(
                f"the step reads {name}, a jax.Array of shape {value.shape} split over "
                f"devices ({value.sharding}), from outside its arguments: inside the step "
                "each replica runs on its own rows, and a closed-over array is not split "
                f"with them. Pass {name} to the step as an argument (a batch argument is "
                "split with the batch; shapes inside the step are the replica's)")


def check_on_one_device(body: Any, mesh: Any, args: tuple, specs: tuple, rows: int = 1,
                        scalars: Sequence[str] = ()) -> Any:
    """Traces the step once as the single-device step would run it (the global
    shapes, one device), so every shape error it would raise is raised here,
    with single-device shapes, rather than slipping through per-replica shapes.
    Returns the trace (its body returns the probe's outputs: fleet.semantics._outputs
    reads it); ``rows`` multiplies the batch's rows (the global batch's, once more).

    A failure of JAX's replica typing alone (the trace fails typed and succeeds
    untyped, ``check_vma=False``) is not blamed on one device, where every value
    is the same on every replica: the replay then returns ``None``, and the
    per-replica trace explains it (:func:`fleet.semantics._trace_errors.typing_failure`). A
    collective over an axis other than ``data`` is refused naming the axis and
    the user's line (:func:`fleet.semantics._trace_errors.unbound_collective`).
    ``scalars``: the step's Python scalar arguments, traced, named for a step
    that uses one in Python control flow."""
    one = jax.sharding.Mesh(np.array(list(mesh.devices.flat)[:1]), (DATA_AXIS,))

    def struct(x: Any, scale: int = 1) -> Any:
        aval = jax.typeof(x)  # (weak types kept: a Python scalar traces as the probe's)
        shape = (aval.shape[0] * scale, *aval.shape[1:]) if aval.shape else ()
        return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type)

    structs = [jax.tree.map(struct, a) for a in args]
    structs[2] = jax.tree.map(lambda x: struct(x, rows), args[2])  # the batch

    def traced(check_vma: bool) -> Any:
        return jax.make_jaxpr(jax.shard_map(body, mesh=one, in_specs=specs,
                                            out_specs=P(DATA_AXIS), check_vma=check_vma))(*structs)

    try:
        return traced(True)
    except FleetError:
        raise
    except Exception as e:
        unbound = _trace_errors.unbound_collective(lambda: traced(False))
        if unbound is not None:
            raise unbound from None
        try:
            traced(False)
        except Exception:
            pass
        else:
            return None  # replica typing only: the per-replica trace explains it
        if not isinstance(e, (TypeError, ValueError)):
            raise
        shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(args[2])]
        raise FleetError(
            f"the step fails as a single-device step on the global batch (batch shapes "
            f"{shapes}), so it is refused here too: {type(e).__name__}: {e}"
            + _hints.traced_scalars(e, scalars)
        ).with_traceback(_trace_errors.user_traceback(e.__traceback__)) from None



def summed_state(jaxpr: Any, kinds: tuple, state_names: list[str], trees: list) -> list[str]:
    """Names of the state leaves whose values reach an implicit cast to varying in
    the traced body (the casts whose transpose is JAX's sum over replicas): the
    leaf itself, or a value computed from it outside the wrapped model's sync."""
    body = next((e.params["jaxpr"] for e in jaxpr.jaxpr.eqns
                 if e.primitive.name == "shard_map"), None)
    if body is None:
        return []
    tree_pos = [i for i, k in enumerate(kinds) if k == TREE]
    names = list(state_names) + [
        f"{nth(tree_pos[i])} leaf {dotted(p)!r}"
        for i, t in enumerate(trees) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
    deps: dict[int, frozenset] = {id(v): frozenset([i])
                                  for i, v in enumerate(body.invars[:len(names)])}
    found: list[int] = []
    for eqn in body.eqns:
        came_from = frozenset().union(*(deps.get(id(v), frozenset()) for v in eqn.invars))
        if eqn.primitive.name in ("pvary", "pcast"):
            found += sorted(i for i in came_from if i not in found)
        elif eqn.params.get("name") not in _sync.FLEET_CALLS and came_from:
            for v in eqn.outvars:  # (fleet's own collectives end a dependence: synced)
                deps[id(v)] = came_from
    return [names[i] for i in found]


ALL_REDUCED_DIFFERENTIATED = (
    "the step differentiates a value of fleet.all_reduce combined with each replica's own "
    "values ({where}). JAX sums that value's gradient over the {n} replicas, on top of the "
    "global gradient fleet.all_reduce already gives it: N times the single-device "
    "gradient. Differentiate the replica's own share and all-reduce only what the "
    "gradient does not pass through: for a load-balancing loss, E * jnp.sum("
    "fleet.all_reduce(frac.mean(0), 'avg') * probs.mean(0)) (the routed fraction "
    "all-reduced, the router's mean probability the replica's own: averaged over the "
    "replicas, its value and its gradient are the single-device ones); for rows "
    "normalised by their batch's mean and variance, an nnx.BatchNorm(use_scale=False, "
    "use_bias=False) with strategy.sync_batch_norm = True, which averages the statistics "
    "over the replicas with their gradient. A loss computed from all-reduced values "
    "alone (fleet.all_reduce(z1.T @ z2 / n, 'avg') and a function of it) is exact")


def all_reduced_casts(jaxpr: Any) -> list[str]:
    """Where the traced body casts a float value computed from ``fleet.all_reduce``
    to varying (combines it with a replica's own values): the cast's transpose is
    JAX's sum over the replicas of a cotangent that the all-reduce's global adjoint
    (``fleet.comm._collective``) already counts for every replica."""
    body = next((e.params["jaxpr"] for e in jaxpr.jaxpr.eqns
                 if e.primitive.name == "shard_map"), None)
    if body is None:
        return []
    scope = Scope(body)
    return [_compat.user_line(e) or f"a {e.primitive.name} in the step" for e in body.eqns
            if e.primitive.name in ("pvary", "pcast") and any(
                not isinstance(v, Literal) and jnp.issubdtype(v.aval.dtype, jnp.inexact)
                and uses_all_reduce(v, scope) for v in e.invars)]


def agree_replicated(fn: Any, kinds: tuple, repl: list, last: Any) -> Any:
    """Replicated step arguments (Python scalars) must be equal on every process:
    checked when they change."""
    values = tuple(np.asarray(v).item() for v in repl)
    if values == last:
        return last

    mine = json.dumps([repr(v) for v in values])
    everyone = agree(f"step-args/{getattr(fn, '__qualname__', 'step')}", mine)
    positions = [i for i, k in enumerate(kinds) if k == REPL]
    for rank, text in enumerate(everyone):
        theirs = json.loads(text)
        for pos, a, b in zip(positions, json.loads(mine), theirs):
            if a != b:
                raise FleetError(
                    f"the step's {nth(pos)[4:]} is {a} on process {jax.process_index()} but "
                    f"{b} on process {rank}; a scalar passed to the step is replicated "
                    "and must be equal on every process (compute it the same way on "
                    "all of them, or pass per-process values as batch rows)"
                )
    return values


def agree_program(fn: Any, kinds: tuple, no_sync: bool, batch: list, state: list,
                  w: Any) -> list:
    """The cross-process program guard (see the module docstring). Returns every
    process's :func:`fleet.step._rows.fingerprint` of its batch rows, exchanged in the
    same message, in rank order."""
    fields = {
        "step function": getattr(fn, "__qualname__", repr(fn)),
        "argument kinds": list(kinds),
        "batch shapes (per process)": [
            [list(np.shape(x)) + [str(np.result_type(x))] for x in jax.tree.leaves(b)]
            for b in batch],
        "state": [[list(np.shape(x)), str(x.dtype)] for x in state],
        "strategy": repr(w.strategy),
        "no_sync": no_sync,
        "replicas": w.num_replicas,
    }
    mine = json.loads(json.dumps(fields, sort_keys=True, default=str))
    message = json.dumps({"program": mine, "rows": _rows.fingerprint(batch)})
    everyone = [json.loads(text) for text in agree(f"step/{fields['step function']}", message)]
    rank = jax.process_index()
    for other, theirs in enumerate(everyone):
        theirs = theirs["program"]
        if theirs == mine:
            continue
        field = next(k for k in fields if mine[k] != theirs.get(k))
        raise FleetError(
            f"the processes compiled different steps: rank {rank} and rank {other} differ "
            f"in {field!r} (rank {rank}: {mine[field]}, rank {other}: "
            f"{theirs.get(field)}). Every process must run the same step with the same "
            "strategy and batch shapes"
        )
    return [e["rows"] for e in everyone]
