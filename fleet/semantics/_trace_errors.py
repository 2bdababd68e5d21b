"""Why a step's trace failed, said in the step's terms.

A step runs once per replica under ``jax.shard_map(..., check_vma=True)``: JAX
types every value as *invariant* (the same on every replica) or *varying*. Two
failures of a trace are about that world, not about the user's computation, and
JAX's own messages for them do not say so:

* a collective over an axis a fleet step does not have (``jax.lax.pmean(x,
  "batch")`` kept from a ``jax.pmap`` script): JAX fails with a bare
  ``AssertionError`` (typed trace) or ``NameError`` (untyped) deep in its frames.
  :func:`unbound_collective` finds the call in the traceback (the collective
  JAX's frames were in, and the axis name it was given) and refuses the step
  naming the axis and the user's line;
* a loop carry that starts invariant and comes out varying (gradient
  accumulation over micro-batches with ``jax.lax.scan``, the loss summed in a
  carry started at ``0.0``). ``jax.lax.scan`` (and ``while_loop``,
  ``fori_loop``) needs the carry's type to be the same in and out, and does not
  cast a carry to varying itself (jax 0.10: its fixpoint covers weak types only).
  fleet cannot cast the user's ``0.0`` either, so the step is refused (no
  patching of JAX's loops): :func:`typing_failure` re-traces the step untyped,
  and if that succeeds, finds the carries in the untyped program
  (:func:`varying_carries`) and says what to write.

Both are raised from the user's line, not from JAX's frames.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import flax
import jax
import optax
from jax.extend.core import Literal, jaxprs_in_params

from fleet import _compat
from fleet._errors import FleetError
from fleet.runtime._world import DATA_AXIS

_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, flax, optax)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,)

_CARRY_HINT = (
    "Start such a carry per replica: `jnp.zeros_like(x, shape=())` for a float "
    "scalar (x a batch argument: the same program on one device), or "
    "`jax.lax.pcast(0.0, fleet.DATA_AXIS, to='varying')` inside a step. fleet combines "
    "the value the step returns from it as any per-replica output (a float scalar: "
    "the mean over the replicas, the global-batch value)")


#: Flax's recurrent layers (their scan's file), and how to start their carry per replica
_RNNS = {
    os.path.join("flax", "nnx", "nn", "recurrent.py"): (
        "nnx.RNN's", "rnn.cell.initialize_carry(x[:, 0].shape, rnn.rngs)"),
    os.path.join("flax", "linen", "recurrent.py"): (
        "Linen nn.RNN's", "cell.initialize_carry(jax.random.key(0), x[:, 0].shape)"),
}
_RNN_HINT = (
    " The loop is {layer}: its carry starts from its cell's initialize_carry, the same "
    "on every replica. Pass one made from the batch (x: the RNN's input, batch first; the "
    "same program on one device): rnn(x, initial_carry=jax.tree.map(lambda c: c + "
    "jnp.zeros_like(x, shape=c.shape), {init}))")


def _is_user(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not path.startswith(_LIBRARIES) and not path.startswith(os.path.dirname(
        os.__file__) + os.sep)


def user_frames(tb: Any) -> list:
    """The frames of ``tb`` (outermost first) in the user's code: outside jax,
    flax, optax, fleet and Python's own library."""
    return [(f, line) for f, line in traceback.walk_tb(tb) if _is_user(f.f_code.co_filename)]


def _where(frame: Any, line: int) -> str:
    return f"{frame.f_code.co_filename}:{line}"


def user_traceback(tb: Any) -> Any:
    """A traceback of the user's frames of ``tb`` only, ending at the user's line
    that failed (what a FleetError raised for that line carries)."""
    out = None
    for frame, line in reversed(user_frames(tb)):
        out = type(tb)(out, frame, frame.f_lasti, line)
    return out


def split_failure(error: Exception, split: list[tuple[str, list[tuple]]], replicas: int,
                  positions: tuple[int, ...]) -> FleetError:
    """The error for a step that traces as the single-device step on the global
    batch but raises ``error`` on a replica's share of it: the arguments fleet
    split (``split``: each one's name and its leaves' global shapes, at
    ``positions``), and how to keep an array that is not batch data whole. Its
    traceback is the user's frames, ending at the line that failed."""
    def share(shape: tuple) -> str:
        return f"{shape} as {(shape[0] // replicas, *shape[1:])}"

    listing = "; ".join(
        f"{name} {', '.join(map(share, shapes[:3]))}{', ...' if len(shapes) > 3 else ''}"
        for name, shapes in split)
    rows = next((s[0] for _, shapes in split for s in shapes if s), "n")
    users = user_frames(error.__traceback__)
    where = f" ({_where(*users[-1])})" if users else ""
    return FleetError(
        f"the step traces as the single-device step on the global batch but fails on a "
        f"replica's share of it{where}: {type(error).__name__}: {error}. Inside a fleet step every "
        f"array argument is batch data, split along its leading axis over the {replicas} "
        f"replicas: {listing}. An array that is not batch data (class weights, a lookup "
        f"table, a projection matrix) is split too: pass distributed_step(fn, batch_argnums="
        f"...) naming only the batch's positions (split now: {positions}), and the other "
        f"arrays reach every replica whole. Code written for the global batch's size "
        f"(x.reshape({rows}, -1), jnp.arange({rows})) should use x.shape[0], the replica's rows"
    ).with_traceback(user_traceback(error.__traceback__))


def unbound_collective(retrace: Callable[[], Any]) -> FleetError | None:
    """Re-runs ``retrace`` (an untyped trace of the step that raised) with JAX's
    frames kept; if it raises ``NameError`` inside a ``jax.lax`` collective whose
    axis is not fleet's, the error to raise instead (its traceback the user's
    frames), else ``None``."""
    try:
        with _compat.unfiltered_tracebacks():
            retrace()
    except NameError as e:  # JAX's error for an axis name that no transformation bound
        calls = _compat.collective_calls(e.__traceback__)
        if not calls:
            return None
        name, axis, caller = calls[0]
        axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
        if not any(a != DATA_AXIS for a in axes):
            return None
        users = user_frames(e.__traceback__)
        where = (f"{caller.filename}:{caller.lineno}" if _is_user(caller.filename)
                 else _where(*users[-1]) if users else "the step")
        given = axes[0] if len(axes) == 1 else axes
        error = FleetError(
            f"a collective over an axis other than fleet's {DATA_AXIS!r}: jax.lax.{name}(..., "
            f"axis_name={given!r}) at {where}. Inside a fleet step the only axis is "
            f"fleet.DATA_AXIS ({DATA_AXIS!r}), the replicas, and fleet already averages the "
            "loss, the metrics and the wrapped model's gradients over them, so a pmean kept "
            "from a jax.pmap script goes; to combine a value of your own across the replicas, "
            "use fleet.all_reduce (or name the axis fleet.DATA_AXIS)")
        return error.with_traceback(user_traceback(e.__traceback__))
    except Exception:  # noqa: BLE001 (another failure: the caller raises the first one)
        return None
    return None


def typing_failure(error: Exception, untyped: Callable[[], Any]) -> FleetError | None:
    """The step's typed trace raised ``error``. If the same step traces untyped
    (``untyped`` returns the jaxpr of its ``shard_map``), the failure is JAX's
    replica typing: the error to raise, naming the loop carries that start
    invariant and come out varying, else JAX's own message whole. ``None`` when
    the untyped trace fails too (the step's own error, which the caller raises)."""
    try:
        jaxpr = untyped()
    except Exception:  # noqa: BLE001
        return None
    shmap = next((e for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"), None)
    carries = [] if shmap is None else varying_carries(
        shmap.params["jaxpr"], [DATA_AXIS in _spec_axes(s) for s in shmap.params["in_specs"]])
    users = user_frames(error.__traceback__)
    where = f" at {_where(*users[-1])}" if users else ""
    if carries:
        what = ", ".join(f"{kind} carry {i} ({aval})" for kind, i, aval in carries[:3])
        message = (
            f"the step's loop{where} carries a value that starts the same on every replica "
            f"and comes out different on each ({what}): inside a step the function runs "
            "once per replica, a value computed from the batch differs per replica, and "
            "jax.lax.scan / fori_loop / while_loop need a carry to keep its type. A carry "
            "started from a constant (`0.0`, `jnp.zeros(...)`) or from the parameters, "
            f"and summed with a loss, is such a carry. {_CARRY_HINT}")
        rnn = _rnn_scan(shmap.params["jaxpr"])
        if rnn is not None:
            layer, init = _RNNS[rnn]
            message += _RNN_HINT.format(layer=layer, init=init)
    else:
        message = (
            f"the step traces on one device but not once per replica{where}: JAX's "
            "typing of values as the same on every replica (invariant) or per replica "
            f"(varying) refuses it. JAX says: {type(error).__name__}: {error}")
    return FleetError(message).with_traceback(user_traceback(error.__traceback__))


def _rnn_scan(jaxpr: Any) -> str | None:
    """The file of Flax's recurrent layer (:data:`_RNNS`) that made a scan of
    ``jaxpr`` (at any depth), if one did."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "scan":
            made = next((f for f in _RNNS if _compat.made_in(eqn, f)), None)
            if made is not None:
                return made
        for sub in jaxprs_in_params(eqn.params):
            made = _rnn_scan(sub)
            if made is not None:
                return made
    return None


def varying_carries(jaxpr: Any, varying: list[bool]) -> list[tuple[str, int, str]]:
    """The loop carries of ``jaxpr`` (an untyped per-replica body, its inputs
    ``varying`` or not) that start invariant and come out varying: ``(loop, index,
    type)``. A value is varying if any input of the equation that makes it is,
    except the outputs of a psum (invariant) and of ``axis_index`` and the
    per-replica collectives (varying)."""
    found: list[tuple[str, int, str]] = []
    _propagate(jaxpr, varying, found)
    return found


_SUMS = ("psum", "pmax", "pmin", "psum_invariant", "pbroadcast")
_PER_REPLICA = ("axis_index", "ppermute", "pshuffle", "all_gather", "reduce_scatter",
                "psum_scatter", "all_to_all", "pvary", "pcast")


def _propagate(jaxpr: Any, varying_in: list[bool], found: list) -> list[bool]:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    env = {id(v): bool(x) for v, x in zip(jaxpr.invars, varying_in)}

    def read(v: Any) -> bool:
        return False if isinstance(v, Literal) else env.get(id(v), False)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "scan":
            outs = _loop(eqn.params["jaxpr"], ins, *_compat.scan_counts(eqn.params),
                         "jax.lax.scan", found)
        elif name == "while":
            nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            outs = _loop(eqn.params["body_jaxpr"], ins[nc:], nb, len(ins) - nc - nb,
                         "jax.lax.while_loop", found)[:len(eqn.outvars)]
        elif name == "cond":
            branches = [_propagate(b, ins[1:], found) for b in eqn.params["branches"]]
            outs = [ins[0] or any(b[i] for b in branches) for i in range(len(eqn.outvars))]
        elif name in _SUMS and DATA_AXIS in _axes(eqn.params):
            outs = [False] * len(eqn.outvars)
        elif name in _PER_REPLICA:
            outs = [True] * len(eqn.outvars)
        else:
            subs = list(jaxprs_in_params(eqn.params))
            sub = subs[0] if len(subs) == 1 else None
            if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(ins):
                outs = _propagate(sub, ins, found)
            else:
                outs = [any(ins)] * len(eqn.outvars)
        for v, x in zip(eqn.outvars, outs):
            env[id(v)] = x
    return [read(v) for v in jaxpr.outvars]


def _spec_axes(spec: Any) -> set:
    out: set = set()
    for entry in spec:
        out.update(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return out


def _axes(params: dict) -> tuple:
    axes = params.get("axes", params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _loop(body: Any, ins: list[bool], num_consts: int, num_carry: int, kind: str,
          found: list) -> list[bool]:
    """A loop's outputs (carries, then stacked outputs), its carries' fixpoint
    first; records the carries whose input was invariant and whose fixpoint is not."""
    consts, init, rest = ins[:num_consts], ins[num_consts:num_consts + num_carry], \
        ins[num_consts + num_carry:]
    carry = list(init)
    scratch: list = []
    while True:
        outs = _propagate(body, consts + carry + rest, scratch)
        new = [a or b for a, b in zip(carry, outs[:num_carry])]
        if new == carry:
            break
        carry = new
    outs = _propagate(body, consts + carry + rest, found)
    avals = getattr(body, "in_avals", None) or [v.aval for v in body.jaxpr.invars]
    for i, (a, b) in enumerate(zip(init, carry)):
        if b and not a:
            found.append((kind, i, avals[num_consts + i].str_short()))
    return carry + outs[num_carry:]
