"""``check_nan_inf``'s select of the new state, made where the distributed
optimizers make it: their updates recorded in the trace and replayed under the
chain (the chain itself, and the host side: :mod:`fleet.sections._finite`).

The select costs no memory when it is made where the optimizer makes the new
state (:class:`Recorder`). Written after the step, as one more pass, it does:
Adam's new parameter reads the new moments, and XLA fuses each moment's update
into both the parameter's select and the moment's own, so the old moment is
read again after the moment's select overwrote it in place, and XLA copies the
old moments first (the MLP of benchmarks/donation.py held 16 MB more per
device, a tenth of its step). So each distributed optimizer's update is
recorded during the trace (:func:`replay`), and once the body knows the chain
it is replayed with the chain: each new state leaf selected where the update
makes it, the updates (and the new parameters, selected too) computed from the
selected state, which is the new one whenever the chain holds: bitwise the same
state, the moments written in place, the parameters read from them as without
the check. The update's first, unselected values are then unused and XLA drops
them (a step that reads the new parameters, say for an output, keeps both).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

from fleet import _compat
from fleet.comm._sync import current, is_varying


def recorder() -> Recorder | None:
    """The recorder of the step body being traced with ``check_nan_inf``, if any
    (the trace's: fleet.comm._trace.FiniteFlags.recorder)."""
    trace = current()
    return None if trace is None else trace.finite.recorder


class Recorder:
    """The distributed optimizers' updates in one trace of a step body, each
    replayable under the chain (see the module docstring)."""

    def __init__(self) -> None:
        self._trace = core.get_opaque_trace_state(convention="fleet")
        self._updates: list = []  # (new leaves, old leaves, replay: pred -> selected leaves)

    def add(self, new: Sequence, old: Sequence, replay: Callable[[Any], list]) -> None:
        """An update wrote ``new`` over ``old``; ``replay(pred)`` gives
        ``where(pred, new, old)`` per leaf, the select made where the update
        makes each. An update traced inside a transformation of the step's own
        (``jax.lax.cond``, ``jax.jit``...) cannot be replayed outside it: its
        leaves get the select after the step."""
        if core.get_opaque_trace_state(convention="fleet") == self._trace:
            self._updates.append((list(new), list(old), replay))

    def select(self, chain: Any, new: Sequence, old: Sequence) -> list:
        """``where(chain, new, old)`` per state leaf of the step: an update's leaf
        still as the update left it comes from its replay."""
        replayed = {}
        for written, before, replay in self._updates:
            for n, o, r in zip(written, before, replay(chain)):
                replayed[id(n)] = (r, o)
        out = []
        for n, o in zip(new, old):
            r, before = replayed.get(id(n), (None, None))
            if r is not None and before is o and _same_type(r, n):
                out.append(r)  # selected against this very old leaf already
            else:
                out.append(jnp.where(chain, n, o))
        return out


def replay(fn: Callable, args: tuple, state_at: int) -> Callable[[Any], Any]:
    """An update ``fn(*args) -> (updates, new_state)`` (``args[state_at]`` the old
    state) as a function of a predicate: ``pred -> (updates, where(pred, new_state,
    old_state))``, each new state leaf selected where ``fn`` makes it, so the
    updates read the selected state. Where ``pred`` holds, bitwise what ``fn``
    gives. ``fn`` is traced (``jax.make_jaxpr``) and evaluated equation by
    equation; a state leaf it passes through, makes twice or makes with another
    type than the old leaf is selected at the end instead."""

    def run(pred: Any) -> Any:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        leaves = jax.tree.leaves(args)  # (the jaxpr's inputs, in its order)
        old = jax.tree.leaves(args[state_at])
        n_updates = len(closed.jaxpr.outvars) - len(old)
        made = closed.jaxpr.outvars[n_updates:]
        counts = collections.Counter(v for v in made if isinstance(v, core.Var))
        given = set(closed.jaxpr.invars) | set(closed.jaxpr.constvars)
        at = {v: o for v, o in zip(made, old) if isinstance(v, core.Var)
              and counts[v] == 1 and v not in given}
        outs, selected = _evaluate(closed, leaves, at, pred)
        outs[n_updates:] = [x if isinstance(v, core.Var) and v in selected
                            else jnp.where(pred, x, o) for v, x, o in zip(made, outs[n_updates:], old)]
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return run


def _evaluate(closed: Any, args: Sequence, at: dict, pred: Any) -> tuple[list, set]:
    """``closed`` evaluated on ``args``, each variable of ``at`` replaced, where it
    is made, by ``where(pred, value, at[variable])``. Returns the outputs and the
    variables so replaced."""
    env: dict = {}
    selected: set = set()

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    env.update(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))
    for eqn in closed.jaxpr.eqns:
        out = _compat.bind_equation(eqn, list(map(read, eqn.invars)))
        for v, x in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]):
            if isinstance(v, core.DropVar):
                continue
            if v in at and _same_type(x, at[v]):
                x = jnp.where(pred, x, at[v])
                selected.add(v)
            env[v] = x
    return [read(v) for v in closed.jaxpr.outvars], selected


def select(pred: Any, new: Any, old: Any) -> Any:
    """``where(pred, new, old)`` per leaf of two trees of one structure."""
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def _same_type(a: Any, b: Any) -> bool:
    """Same shape, dtype and variance over the replicas (so a select of ``a``
    against ``b`` is typed as ``a``)."""
    return (jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
            and is_varying(a) == is_varying(b))
