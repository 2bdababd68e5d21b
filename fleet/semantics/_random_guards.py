"""The draws fleet cannot make exact, refused by name (``fleet.semantics._random`` makes
the others exact).

* :func:`check_draws`: a per-example draw from a key fleet did not re-type (a
  raw ``uint32[2]`` key wrapped in the step, a key made or closed over in the
  step), or with ``jax_threefry_partitionable`` off; a draw that is not per
  example whose leading axis happens to equal the replica's rows (unless its key
  is an optimizer's: :func:`fleet.semantics._random.replicated_impl`); a draw whose
  batch axis is not its leading one (dropout of a transposed activation, noise
  drawn time-major), and keys split per example (``jax.random.split(key,
  x.shape[0])``, ``rngs.fork(split=...)``), each found by pairing the draws of
  the replica's trace with the single-device step's (:func:`check_batch_axes`):
  before this check each trained silently away from one device (4 CPU devices, 3
  SGD steps: 0.32 in the parameters for a dropout of ``x.T``, 0.051 for noise
  drawn from split keys).
* :func:`check_typing`: a value the step leaves typed the same on every replica
  that comes from a per-example draw alone. A re-typed key is the same on every
  replica, so JAX types what it draws so too, while each replica's bits are its
  own rows: once such bits meet the batch (``mask * x``) the type is right again,
  but a value made of them alone (``mask.sum()``) would lie. The probe marks each
  value the step leaves typed so (:func:`fleet_mark`), and :func:`check_typing`
  follows the draws' bits through the probe's trace (into calls, loops' carries
  to a fixed point, branches) to the marks, through values typed the same on
  every replica only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal, jaxprs_in_params

from fleet import _compat
from fleet._errors import FleetError
from fleet.runtime._world import DATA_AXIS
from fleet.semantics._outputs import shard_body
from fleet.semantics._random import key_dtype, replicated_impl, row_impl, threefry_dtype

_RAW_KEY = (
    "the step draws {what} per example (its leading axis, {rows}, is this replica's batch "
    "rows) from a key fleet cannot give each replica's rows: {why}. Every replica would draw "
    "the first rows' bits. Make the key a typed threefry key held by the step's state or "
    "passed to it: jax.random.key(seed) instead of jax.random.PRNGKey(seed) (or "
    "jax.random.wrap_key_data(raw_key) before the call), an nnx.Rngs stream, or a key in "
    "the TrainState")
_NOT_PARTITIONABLE = (
    "the step draws {what} per example, and jax_threefry_partitionable is off: fleet gives "
    "each replica its rows of the single-device draw only with partitionable threefry "
    "(JAX's default since 0.5). Remove jax.config.update('jax_threefry_partitionable', False)")
_AMBIGUOUS = (
    "the step draws {what}, whose leading axis ({rows}) is not the batch on one device but "
    "equals this replica's batch rows: inside the step fleet could not tell it from a draw "
    "per example. Use a global batch size whose per-replica rows differ from that axis, or "
    "give the draw another leading axis (draw shape[::-1] and transpose)")


def check_draws(jaxpr: Any, rows: frozenset, one_device: Any = None,
                global_rows: frozenset = frozenset()) -> None:
    """Refuses the draws of a traced step that fleet cannot make exact (see the
    module docstring): ``jaxpr`` is the per-replica program, ``rows`` the
    replica's batch row counts, ``one_device`` (optional) the program traced as
    the single-device step on the global batch, of ``global_rows`` rows."""
    if not rows:
        return
    ours, optimizers = key_dtype(row_impl(rows)), key_dtype(replicated_impl())
    for eqn, top in _draws(jaxpr):
        shape, key = eqn.params["shape"], eqn.invars[0].aval
        if (not (shape and shape[0] in rows) or DATA_AXIS in key.manual_axis_type.varying
                or key.dtype == optimizers):
            continue  # not per example, from per-example keys (a batch of keys) or an optimizer's
        what = _describe(top, shape)
        if key.dtype != ours:
            why = ("a threefry key made inside the step: a raw uint32 key "
                   "(jax.random.PRNGKey) that jax.random wraps, jax.random.key(...) "
                   "called in the step, or a key the step closes over"
                   if key.dtype == threefry_dtype() else f"a key of type {key.dtype}")
            raise FleetError(_RAW_KEY.format(what=what, rows=shape[0], why=why))
        if not jax.config.jax_threefry_partitionable:
            raise FleetError(_NOT_PARTITIONABLE.format(what=what))
    if one_device is not None:  # (the global batch's rows are not the replica's)
        check_batch_axes(jaxpr, one_device, rows)
        for eqn, top in _draws(one_device):
            shape = eqn.params["shape"]
            if (shape and shape[0] in rows and shape[0] not in global_rows
                    and eqn.invars[0].aval.dtype != optimizers):
                raise FleetError(_AMBIGUOUS.format(what=_describe(top, shape), rows=shape[0]))


def _draws(jaxpr: Any, top: Any = None,
           names: tuple = ("random_bits",)) -> Iterable[tuple[Any, Any]]:
    """Each ``random_bits`` equation (or of ``names``) of ``jaxpr``, with the
    equation of the step's own body that holds it (its source is the user's line)."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        holder = top
        if holder is None and eqn.primitive.name != "shard_map":
            holder = eqn
        if eqn.primitive.name in names:
            yield eqn, holder or eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _draws(sub, holder, names)


_BATCH_AXIS = (
    "the step draws {what}, whose axis {axis} grows with the batch, not as the leading "
    "axis of the batch rows: fleet gives each replica its rows of the single-device draw "
    "only for a draw whose leading axis is the batch rows (x.shape[0]), and this one would "
    "draw the same bits on every replica. Draw "
    "with the batch first: apply the dropout or noise before moving the batch axis (or "
    "draw shape (batch, ...) and transpose it)")
_SPLIT_PER_EXAMPLE = (
    "the step splits a key into one per example ({what}: jax.random.split(key, "
    "x.shape[0]), rngs.fork(split=...)): each replica would split its own count and get "
    "the first rows' keys, not its rows of the single-device split. Draw the per-example "
    "randomness in one draw whose leading axis is the batch rows instead "
    "(jax.random.normal(key, (x.shape[0], ...)), nnx.Dropout on the batch), which fleet "
    "gives each replica exactly")


def check_batch_axes(jaxpr: Any, one_device: Any, rows: frozenset) -> None:
    """Refuses a draw whose batch axis is not its leading one or is not the
    replica's ``rows`` (``(2 * x.shape[0], d)``), and a key split per example: the
    replica's draws and splits (``jaxpr``) paired in order with the single-device
    step's (``one_device``), an axis shorter in the replica's being the batch's.
    Unpaired (the traces' draws differ in number or kind): unchecked."""
    names = ("random_bits", "random_split")
    local, glob = list(_draws(jaxpr, names=names)), list(_draws(one_device, names=names))
    if len(local) != len(glob):
        return
    for (eqn, _), (ref, top) in zip(local, glob):
        ls, gs = tuple(eqn.params["shape"]), tuple(ref.params["shape"])
        if eqn.primitive != ref.primitive or len(ls) != len(gs):
            return
        batch = [i for i, (a, b) in enumerate(zip(ls, gs)) if a != b]
        if batch and eqn.primitive.name == "random_split":
            where = _compat.user_line(top)
            raise FleetError(_SPLIT_PER_EXAMPLE.format(
                what=f"{gs[0]} keys" + (f" at {where}" if where else "")))
        if batch and (batch != [0] or ls[0] not in rows):
            raise FleetError(_BATCH_AXIS.format(what=_describe(top, gs), axis=batch[-1]))


def _describe(eqn: Any, shape: tuple) -> str:
    name = eqn.params.get("name") if eqn.primitive.name in ("pjit", "jit") else None
    what = f"jax.random.{name.lstrip('_')}" if name else "random bits"
    where = _compat.user_line(eqn)
    return f"{what} of shape {tuple(shape)}" + (f" ({where})" if where else "")


_TYPED_SAME = (
    "{what} comes from a random draw per example alone (its leading axis is this "
    "replica's batch rows) and leaves the step as a value the same on every replica: "
    "each replica's bits are its own rows of the single-device draw, so this value "
    "differs across replicas where JAX's types say it does not. Return it through a "
    "value computed from the batch (mask * x), or return the per-example draw itself as "
    "an output")


@jax.jit
def fleet_mark(*xs: jax.Array) -> tuple:
    """The identity, named in the probe's trace: marks the values the step leaves
    typed the same on every replica (state, outputs), for :func:`check_typing`:
    one call for them all (a call each made 782 on the 16-layer Transformer of
    ``benchmarks/first_step.py``)."""
    return xs


def check_typing(jaxpr: Any, rows: frozenset, marked: Sequence[str]) -> None:
    """Refuses a value the step leaves typed the same on every replica that comes
    from a per-example draw alone (its type would lie: each replica drew its own
    rows). ``jaxpr``: the probe, whose body passed each such value through
    :func:`fleet_mark`; ``marked``: their names, in order."""
    if not rows or not marked:
        return
    body = shard_body(jaxpr)
    tainted = _taint(getattr(body, "jaxpr", body), set(), key_dtype(row_impl(rows)), rows)
    marks = [v for e in getattr(body, "jaxpr", body).eqns
             if e.params.get("name") == "fleet_mark" for v in e.invars]
    for name, var in zip(marked, marks):
        if id(var) in tainted:
            raise FleetError(_TYPED_SAME.format(what=name))


def _varying(v: Any) -> bool:
    return DATA_AXIS in v.aval.manual_axis_type.varying


def _taint(jaxpr: Any, seeds: set, ours: Any, rows: frozenset) -> set:
    """Ids of ``jaxpr``'s variables typed the same on every replica that depend on
    a per-example draw of ``ours`` (or on ``seeds``) through such values only."""
    tainted = set(seeds)

    def hit(vs):
        return [not isinstance(v, Literal) and id(v) in tainted for v in vs]

    def spread(outvars, inner_out, inside):
        tainted.update(id(o) for o, i in zip(outvars, inner_out)
                       if id(i) in inside and not _varying(o))

    for eqn in jaxpr.eqns:
        name, params, h = eqn.primitive.name, eqn.params, hit(eqn.invars)
        if name == "random_bits":
            shape, key = params["shape"], eqn.invars[0].aval
            if shape and shape[0] in rows and key.dtype == ours and not _varying(eqn.invars[0]):
                tainted.update(id(v) for v in eqn.outvars)
            continue
        if name in ("scan", "while"):  # the carries, to a fixed point
            if name == "scan":
                inner, ins = params["jaxpr"].jaxpr, h
                start, n = _compat.scan_counts(params)
            else:
                inner, ins = params["body_jaxpr"].jaxpr, h[params["cond_nconsts"]:]
                start, n = params["body_nconsts"], len(eqn.outvars)
            for _ in range(n + 2):
                inside = _taint(inner, {id(v) for v, x in zip(inner.invars, ins) if x},
                                ours, rows)
                back = [id(o) in inside for o in inner.outvars[:n]]
                new = ins[:start] + [a or b for a, b in zip(ins[start:start + n], back)] + (
                    ins[start + n:])
                if new == ins:
                    break
                ins = new
            spread(eqn.outvars, inner.outvars, inside)
            continue
        subs = [getattr(p, "jaxpr", p) for p in jaxprs_in_params(params)]
        for inner in subs:
            offset = len(eqn.invars) - len(inner.invars)  # (cond: the branch index first)
            if offset >= 0 and len(inner.outvars) == len(eqn.outvars):
                inside = _taint(inner, {id(v) for v, x in zip(inner.invars, h[offset:]) if x},
                                ours, rows)
                spread(eqn.outvars, inner.outvars, inside)
            elif any(h) or _taint(inner, {id(v) for v in inner.invars} if any(h) else set(),
                                  ours, rows):
                tainted.update(id(o) for o in eqn.outvars if not _varying(o))
        if any(h) and not subs:
            tainted.update(id(o) for o in eqn.outvars if not _varying(o))
    return tainted

