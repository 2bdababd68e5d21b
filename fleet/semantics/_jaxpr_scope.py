"""Reading a traced step's jaxpr for fleet.semantics._outputs and its walk
(:mod:`fleet.semantics._outputs_walk`): the calls fleet looks into, its gradient
sync, the replica typing (vma) of a variable, the :class:`Scope` of one jaxpr,
two traces' equations paired (:func:`paired_eqns`), and which varying values are
nevertheless the same on every replica (:class:`ReplicaConstant`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal, jaxprs_in_params

from fleet import _compat
from fleet._compat import scan_counts
from fleet._errors import FleetUnsupportedError
from fleet.runtime._world import DATA_AXIS

CUSTOM_VJP_CALLS = ("custom_vjp_call", "custom_vjp_call_jaxpr", "CustomVJPTraced")  # (custom_vjp3)
#: Calls whose inner jaxpr's inputs and outputs are the call's own, in order
#: (``jax.checkpoint`` is ``remat2``, ``RematTraced`` under ``jax_remat3``).
CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2",
         "RematTraced", "custom_jvp_call", *CUSTOM_VJP_CALLS)


def is_sync(eqn: Any) -> bool:
    """Whether an equation is fleet's read of a wrapped model's parameters
    (``fleet.comm._sync``): a custom-VJP call whose forward only casts its
    invariant inputs to varying, or under ZeRO stage 3 gathers their slices
    (``fleet.comm._param_gather``: a call of ``fleet_gather``)."""
    if eqn.primitive.name not in CUSTOM_VJP_CALLS:
        return False
    inner = getattr(eqn.params.get("call_jaxpr"), "jaxpr", None)
    return inner is not None and bool(inner.eqns) and (
        all(e.primitive.name in ("pvary", "pcast") for e in inner.eqns)
        or any(e.params.get("name") == "fleet_gather" for e in inner.eqns))


#: fleet's reductions of a wrapped model's gradient buckets (fleet.comm._hooks)
GRADIENT_BUCKETS = ("fleet_bucket", "fleet_scatter")
#: JAX's own sums over the replicas (the transpose of a cast to varying)
PSUMS = ("psum", "psum_invariant")


def reduces_gradient(eqn: Any) -> bool:
    """Whether an equation is a gradient's reduction over the replicas: one of
    fleet's buckets, or JAX's psum."""
    return eqn.params.get("name") in GRADIENT_BUCKETS or eqn.primitive.name in PSUMS


def holds_reduction(eqn: Any) -> bool:
    """Whether an equation reduces over the replicas (:func:`reduces_gradient`), or
    holds one that does (a loop, a call)."""
    return reduces_gradient(eqn) or any(holds_reduction(e) for sub in jaxprs_in_params(eqn.params)
                                        for e in getattr(sub, "jaxpr", sub).eqns)


def refuse_custom_vjp3() -> None:
    """Raises under ``jax_custom_vjp3``: its traces hide fleet's sync (:func:`is_sync`)."""
    if getattr(jax.config, "jax_custom_vjp3", False):
        raise FleetUnsupportedError(
            "this step sums a value over the batch rows, and fleet cannot check it with jax's "
            "custom_vjp3 upgrade flag on (JAX_CUSTOM_VJP3=1): its traces hide fleet's gradient "
            "sync, so a loss replicas-times too large would pass unseen; turn the flag off "
            "(its default), or take the mean over the rows")


def is_varying_var(v: Any) -> bool:
    """Whether a jaxpr variable is typed varying over ``data`` (shard_map's vma)."""
    aval = v.aval
    return DATA_AXIS in getattr(aval, "vma", getattr(
        getattr(aval, "manual_axis_type", None), "varying", ()))


class Scope:
    """One jaxpr of the walk: who produces each variable, and where its inputs
    come from (the calling equation's inputs in the enclosing scope)."""

    def __init__(self, jaxpr: Any, parent: tuple | None = None, call: Any = None):
        consts = getattr(jaxpr, "consts", ())
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        self.producer = {id(v): e for e in jaxpr.eqns for v in e.outvars}
        self.inputs = {id(v): i for i, v in enumerate(jaxpr.invars)}
        self.consts = {id(v): c for v, c in zip(jaxpr.constvars, consts)}
        self.parent = parent  # (the call's invars, the enclosing scope)
        self.call = call  # the enclosing scope's equation that calls this jaxpr
        self.subs: dict = {}
        self.carry: range = range(0)  # a scan body's carry inputs (by position)

    def inner(self, eqn: Any) -> tuple | None:
        """The scope of a call's jaxpr, when its inputs and outputs are the call's."""
        if eqn.primitive.name not in CALLS:
            return None
        key = id(eqn)
        if key not in self.subs:
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(sub, "jaxpr", sub)
            ok = (sub is not None and hasattr(inner, "eqns")
                  and len(inner.invars) == len(eqn.invars)
                  and len(inner.outvars) == len(eqn.outvars))
            self.subs[key] = (Scope(sub, (eqn.invars, self), eqn), inner) if ok else None
        return self.subs[key]

    def scan_body(self, eqn: Any) -> tuple:
        """The scope of a ``scan``'s body: its inputs are the scan's (constants,
        carry, stacked inputs), its outputs the scan's (carry, stacked outputs),
        except that a carry input holds, after the first iteration, the body's
        own carry output (:attr:`carry`)."""
        key = id(eqn)
        if key not in self.subs:
            sub = eqn.params["jaxpr"]
            scope = Scope(sub, (eqn.invars, self), eqn)
            consts, carries = scan_counts(eqn.params)
            scope.carry = range(consts, consts + carries)
            self.subs[key] = (scope, getattr(sub, "jaxpr", sub))
        return self.subs[key]


def user_line(eqn: Any, scope: Scope) -> str | None:
    """``file:line`` of the user's code that made ``eqn`` of ``scope``: its own
    (fleet._compat.user_line), else that of the call that holds it (the equations
    of a jitted library function, ``jnp.median``'s, were traced without the
    user's frames)."""
    line = _compat.user_line(eqn)
    while line is None and scope is not None and scope.call is not None:
        line = _compat.user_line(scope.call)
        scope = scope.parent[1]
    return line


def paired_eqns(eqns: list, ref: list, window: int = 64) -> list:
    """The equations of two traces paired where their primitives (and calls'
    names) run alike: in order, and where they part, at the nearest place within
    ``window`` equations where they run alike again (ZeRO stage 3's one-device
    reference inserts its own splits and gathers). Linear in the equations: a
    deep model's trace has thousands."""
    if len(eqns) == len(ref):
        return list(zip(eqns, ref))
    a = [(e.primitive.name, str(e.params.get("name", ""))) for e in eqns]
    b = [(e.primitive.name, str(e.params.get("name", ""))) for e in ref]
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            out.append((eqns[i], ref[j]))
            i, j = i + 1, j + 1
        else:
            di, dj = _resync(a, b, i, j, window)
            i, j = i + di, j + dj
    return out


def _resync(a: list, b: list, i: int, j: int, window: int) -> tuple[int, int]:
    """How far to skip in ``a`` or ``b`` (from ``i``, ``j``) for them to run alike
    again, the nearer first; both one when no place within ``window`` does."""
    for d in range(1, window):
        if j + d < len(b) and a[i] == b[j + d]:
            return 0, d
        if i + d < len(a) and a[i + d] == b[j]:
            return d, 0
    return 1, 1


def all_of(first: tuple, key: Callable, look: Callable, memo: dict) -> bool:
    """Whether ``first`` holds, where ``look(*item)`` says whether an item holds (a
    bool) or gives the items it holds exactly when all of them do; each item's
    answer kept in ``memo`` under ``key(item)``. A loop, not a recursion: a deep
    model's chains of values are thousands long."""
    todo = [first]
    while todo:
        k = key(todo[-1])
        if k in memo:
            todo.pop()
            continue
        got = look(*todo[-1])
        if not isinstance(got, bool):
            known = [memo.get(key(item)) for item in got]
            if None in known and False not in known:  # (looked at again once they are)
                todo.extend(item for item, answer in zip(got, known) if answer is None)
                continue
            got = False not in known
        memo[k] = got
        todo.pop()
    return memo[key(first)]


class ReplicaConstant:
    """Which values typed varying are the same on every replica: computed only
    from invariant inputs (the parameters, the replicated state), literals and
    constants, through fleet's sync or a cast to varying (which retype a value
    without changing it) and deterministic operations. A parameter read as
    ``variable[...]`` outside the model's call is such a value (an L2 penalty of
    the read parameters). Anything else is not: the batch, a per-replica value,
    an operation without inputs whose result varies (``axis_index``), and --
    conservatively -- a scan's carry, a while loop or a branch (their bodies are
    not followed; a scan's stacked outputs are, from its stacked inputs and
    constants)."""

    def __init__(self):
        self.memo: dict = {}

    def __call__(self, v: Any, s: Scope) -> bool:
        """Whether ``v`` (of scope ``s``) is (each value looked at once: :func:`all_of`)."""
        return all_of((v, s), lambda p: (id(p[0]), id(p[1])), self._look, self.memo)

    def _look(self, v: Any, s: Scope) -> bool | list:
        """Whether ``v`` is, when that is known from itself; else the values it is
        one of exactly when all of them are (``(value, scope)`` pairs)."""
        if isinstance(v, Literal) or id(v) in s.consts or not is_varying_var(v):
            return True  # (typed invariant: the same on every replica, check_vma=True)
        if id(v) in s.inputs:
            # the body's own varying input (the batch, per-replica state), or a scan's
            # carry (after the first iteration, what the body made of it: not followed)
            if s.parent is None or s.inputs[id(v)] in s.carry:
                return False
            invars, outer = s.parent
            return [(invars[s.inputs[id(v)]], outer)]
        eqn = s.producer.get(id(v))
        if eqn is None:
            return False
        got = s.scan_body(eqn) if eqn.primitive.name == "scan" else s.inner(eqn)
        if got is not None:  # a call or a scan (nnx.scan over layers): its output, inside
            scope, inner = got
            return [(inner.outvars[eqn.outvars.index(v)], scope)]
        if any(True for _ in jaxprs_in_params(eqn.params)):
            return False  # a loop, a branch, another shard_map: not followed
        if not eqn.invars:
            return False  # (varying from nothing: axis_index)
        return [(x, s) for x in eqn.invars]


#: ``fleet.all_reduce``'s 'avg' and 'sum' inside a step (fleet.comm._sync's named calls)
ALL_REDUCES = ("fleet_pmean", "fleet_psum")
#: operations that keep a value (a cast, a reshape, a retyping over the replicas)
#: Operations of values of one shape, element by element.
ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "sign", "floor",
    "ceil", "round", "is_finite", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "abs", "sqrt", "rsqrt", "cbrt", "square", "integer_pow",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "select_n", "clamp", "eq", "ne", "lt",
    "le", "gt", "ge", "and", "or", "not", "xor", "convert_element_type", "copy", "copy_p",
    "pvary", "pcast", "reduce_precision", "add_any", "stop_gradient", "nextafter", "imag", "real",
    "conj", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
))

KEEPS_VALUE = ("pvary", "pcast", "copy", "copy_p", "reshape", "broadcast_in_dim", "squeeze",
               "expand_dims", "reduce_precision", "stop_gradient", "convert_element_type")


def all_reduced(v: Any, s: Scope) -> tuple | None:
    """``(call, operand, its scope)`` when ``v`` is the value of ``fleet.all_reduce``'s
    'avg' or 'sum' in a step (:data:`ALL_REDUCES`, inside the calls around it: its
    global adjoint's custom VJP), cast (to varying: a division of a replica's value
    by it) or reshaped, else None."""
    for _ in range(400):
        eqn = s.producer.get(id(v))
        if eqn is None:
            return None
        if eqn.primitive.name in KEEPS_VALUE and len(eqn.invars) == 1:
            v = eqn.invars[0]
            continue
        i = eqn.outvars.index(v)
        if eqn.params.get("name") in ALL_REDUCES:
            return eqn.params["name"], eqn.invars[i], s
        got = s.inner(eqn)
        if got is None:
            return None
        s, v = got[0], got[1].outvars[i]
    return None


def uses_all_reduce(v: Any, s: Scope) -> bool:
    """Whether ``v`` is computed from a value of ``fleet.all_reduce``'s 'avg' or
    'sum' (:func:`all_reduced`), in its scope or the calls it makes (each value
    looked at once)."""
    todo, seen = [(v, s)], set()
    while todo:
        v, s = todo.pop()
        if isinstance(v, Literal) or (id(v), id(s)) in seen:
            continue
        seen.add((id(v), id(s)))
        if all_reduced(v, s) is not None:
            return True
        eqn = s.producer.get(id(v))
        got = None if eqn is None else s.inner(eqn)
        if got is not None:
            todo.append((got[1].outvars[eqn.outvars.index(v)], got[0]))
        elif eqn is not None:
            todo.extend((x, s) for x in eqn.invars)
    return False
