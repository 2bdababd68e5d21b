"""Per-example gradients of replicated parameters: refused by name.

A step that takes a gradient per example -- ``jax.vmap`` or ``nnx.vmap`` of
``jax.grad`` / ``nnx.grad`` over the batch rows, as Optax's
``optax.contrib.dpsgd`` (DP-SGD), per-example clipping or per-example gradient
norms need -- gets, on one device, one gradient for each row of the global
batch. Inside a fleet step each replica computes those of its own rows, and the
parameter's gradient is then reduced over the replicas as every gradient of it
is: a wrapped model's bucket averages it (:mod:`fleet.comm._sync`), JAX's
transpose of the parameter's cast to varying sums it (which a distributed
optimizer divides). Under ``vmap`` that reduction is batched: example ``i`` of
every replica is averaged with example ``i`` of the others, so each
"per-example" gradient is a mean of N rows' gradients, and a clip, a norm or
noise divided by the batch size taken of it differs from one device. Measured
before this check: ``optax.contrib.dpsgd`` on a two-layer MLP, 5 steps on 4 CPU
devices, ended 0.033 from one device without noise and 0.12 with it; a wrapped
model with a plain or a distributed ``nnx.Optimizer``, a raw model with a
distributed one, and a Linen ``apply`` all trained so, with no error.

The probe's jaxpr shows it (:func:`check_per_example`): a reduction over the
replicas of a gradient has the shape of what the step read -- a wrapped model's
bucket (``fleet_bucket``) the shapes of the parameters its sync read, JAX's
``psum`` the shape of the value it cast to varying, ZeRO's reduce-scatter
(``fleet_scatter``) ``(degree, chunk)`` rows -- unless it is batched, when it
has one more axis, of the replica's batch rows. (An ensemble's parameters,
stacked and read under ``vmap``, are batched as their reads are: the bucket has
the read's shape. Under ZeRO the rows do not say so: an ensemble whose
stacked axis is as long as the replica's batch rows would be refused.)

Gradients per group of rows are refused alike (DP-SGD's microbatches:
``jax.vmap`` of a gradient over ``x.reshape(-1, k, ...)``, 0.038 from one device
in the parameters after 4 steps before this check): a batched axis as long as
the groups a reshape of the rows makes (:func:`_groups`) is one of the replica's
rows' too.

Per-example gradients taken in a loop over the rows (``jax.lax.map``, a
``scan`` over ``(x, y)``) reduce at the parameters' shape, once per row: the
loop shows them (:func:`_row_loops`), a ``scan`` that stacks a reduced gradient
and runs once per row of the replica where the single-device step's runs once
per row of the global batch (``dpsgd`` so: 0.019 from one device in the
parameters after 3 steps before this check). A forward pass looped over the
rows, differentiated outside the loop, accumulates the gradient in the loop's
carry (exact, accepted); a scan over ``k`` micro-batches runs ``k`` times in
both and stays accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from jax.extend.core import Literal, jaxprs_in_params

from fleet._compat import scan_counts
from fleet._errors import FleetError
from fleet.comm._sync import FLEET_CALLS
from fleet.semantics._jaxpr_scope import GRADIENT_BUCKETS, PSUMS, is_sync, is_varying_var

_PER_EXAMPLE = (
    "the step takes gradients per example (jax.vmap or nnx.vmap of a gradient over the "
    "batch rows: {what} came back with shape {shape}, one row per example of this "
    "replica's {rows}). fleet reduces a parameter's gradient over the replicas as a whole; "
    "under vmap that reduction averages example i of every replica, so each per-example "
    "gradient, and a clip, a norm or noise taken of it (optax.contrib.dpsgd), would differ "
    "from one device. fleet does not make per-example gradients exact: differentiate the "
    "loss over the whole batch (its mean over the rows), or train this step on one device")

_PER_EXAMPLE_LOOP = (
    "the step takes gradients per example in a loop over the batch rows (jax.lax.map or "
    "a scan over the rows: it runs once per row, {rows} on this replica, and reduces a "
    "gradient inside). fleet reduces a parameter's gradient over the replicas as a whole; "
    "inside the loop that reduction averages example i of every replica, so each "
    "per-example gradient, and a clip, a norm or noise taken of it (optax.contrib.dpsgd), "
    "would differ from one device. fleet does not make per-example gradients exact: "
    "differentiate the loss over the whole batch (its mean over the rows), or train this "
    "step on one device")


def check_per_example(jaxpr: Any, rows: frozenset, named: Sequence[tuple[str, tuple]],
                      reference: Any = None, replicas: int = 1) -> None:
    """Refuses a probe whose gradient reductions are batched over the replica's
    batch ``rows``, or run in a loop over them (see the module docstring).
    ``named``: (name, shape) of the step's state and pytree leaves, to name a
    parameter by its shape; ``reference``: the single-device step's trace, of
    ``replicas`` times the rows."""
    if not rows:
        return
    looped = _row_loops(jaxpr, rows)
    if looped and reference is not None and _row_loops(
            reference, frozenset(r * replicas for r in rows)):
        raise FleetError(_PER_EXAMPLE_LOOP.format(rows=looped[0]))
    reads: set = set()
    reductions: list = []
    groups: set = set()
    _collect(getattr(jaxpr, "jaxpr", jaxpr), reads, reductions, rows, groups)
    found = [(zero, shapes, base, size) for zero, shapes in reductions if shapes not in reads
             for base, size in _unbatched(shapes, rows | groups)
             if (all(len(s) == 2 for s in base) if zero else base in reads)]
    if not found:
        return
    names = {}
    for name, shape in named:
        names.setdefault(tuple(shape), []).append(name)
    # (a parameter's own gradient first: JAX's psum may be of a value made from it)
    zero, shapes, base, size = next((f for f in found if f[2][0] in names), found[0])
    known = [] if zero else names.get(base[0], [])
    what = (f"strategy.sharding's slices of a gradient, rows {base[0]}," if zero else
            f"the gradient of shape {base[0]}" if not known else
            f"the gradient of {'; '.join(known[:2])}{'; ...' if len(known) > 2 else ''}"
            f" (shape {base[0]})")
    raise FleetError(_PER_EXAMPLE.format(what=what, shape=shapes[0], rows=(
        f"{size} rows" if size in rows else
        f"rows in {size} groups (x.reshape(-1, k, ...): DP-SGD's microbatches)")))


def _row_loops(jaxpr: Any, rows: frozenset) -> list[int]:
    """The lengths, one of ``rows``, of the loops (``scan``) of ``jaxpr`` that
    stack a gradient reduced over the replicas in their body (one per row: its
    per-row outputs, not its carry, where a loop's transpose accumulates a read
    parameter's gradient)."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        subs = [getattr(sub, "jaxpr", sub) for sub in jaxprs_in_params(eqn.params)]
        if eqn.primitive.name == "scan" and eqn.params["length"] in rows:
            body = eqn.params["jaxpr"].jaxpr
            reduced = _reduced(body)
            if any(id(v) in reduced for v in body.outvars[scan_counts(eqn.params)[1]:]):
                found.append(eqn.params["length"])
                continue
        if eqn.params.get("name") not in FLEET_CALLS:
            found.extend(n for sub in subs for n in _row_loops(sub, rows))
    return found


def _reduced(jaxpr: Any) -> set:
    """The ids of ``jaxpr``'s variables computed from a gradient reduced over the
    replicas (a bucket's, JAX's psum's outputs, and what follows from them)."""
    out: set = set()
    for eqn in jaxpr.eqns:
        if (eqn.params.get("name") in GRADIENT_BUCKETS or eqn.primitive.name in PSUMS
                or any(id(v) in out for v in eqn.invars if not isinstance(v, Literal))
                or any(_reduced(getattr(sub, "jaxpr", sub))
                       for sub in jaxprs_in_params(eqn.params))):
            out.update(map(id, eqn.outvars))
    return out


def _collect(jaxpr: Any, reads: set, reductions: list, rows: frozenset, groups: set) -> None:
    """The shapes ``jaxpr`` reads replicated values at (a sync's inputs and
    outputs, a cast to varying's invariant input: tuples) and reduces gradients
    at (a bucket's operands as one tuple, each operand of JAX's own psum as its
    own), each with whether it is ZeRO's reduce-scatter, whose operands are
    ``(degree, chunk)`` rows (``fleet.comm._shard_comm.ReduceScatter``): 2-D,
    unless batched; and into ``groups``, how many groups of the replica's ``rows``
    a reshape makes (``x.reshape(-1, k, ...)``: ``rows / k``)."""
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name")
        if eqn.primitive.name == "reshape":
            groups.update(_groups(eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape, rows))
        if is_sync(eqn):  # (stage 3's sync reads slices and gives whole parameters)
            reads.update((_shapes(eqn.invars), _shapes(eqn.outvars)))
            continue
        if name in GRADIENT_BUCKETS:
            reductions.append((name == "fleet_scatter", _shapes(eqn.invars)))
            continue
        if name in FLEET_CALLS:
            continue
        prim = eqn.primitive.name
        if prim in ("pvary", "pcast"):
            reads.update(_shapes([v]) for v in eqn.invars
                         if not isinstance(v, Literal) and not is_varying_var(v))
        elif prim in PSUMS:
            reductions.extend((False, _shapes([v])) for v in eqn.invars)
        for sub in jaxprs_in_params(eqn.params):
            _collect(getattr(sub, "jaxpr", sub), reads, reductions, rows, groups)


def _groups(old: tuple, new: tuple, rows: frozenset) -> set:
    """The leading lengths ``a`` where a reshape splits an axis of the rows in two,
    ``(..., rows, ...) -> (..., a, b, ...)`` with both more than one."""
    return {new[i] for i in range(min(len(old), len(new) - 1))
            if old[:i] == tuple(new[:i]) and old[i] in rows and new[i] > 1 and new[i + 1] > 1
            and new[i] * new[i + 1] == old[i]}


def _shapes(invars: Iterable) -> tuple:
    return tuple(tuple(v.aval.shape) for v in invars)


def _unbatched(shapes: tuple, rows: frozenset) -> Iterator[tuple[tuple, int]]:
    """``shapes`` without one axis of the same length, one of ``rows``, at the
    same place in each (as a batched reduction would have it), and that length:
    each such axis."""
    if not shapes or any(not s for s in shapes):
        return
    for axis in range(min(len(s) for s in shapes)):
        size = shapes[0][axis]
        if size in rows and all(s[axis] == size for s in shapes):
            yield tuple(s[:axis] + s[axis + 1:] for s in shapes), size
