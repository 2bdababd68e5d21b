"""Buffer donation: a step gives the NNX objects' old state to XLA.

A step writes new arrays into the NNX objects' variables (parameters, optimizer
state, buffers; ``fleet.step._graph.GraphCache``), so the old ones are dead once the
step has run. fleet donates them (``jax.jit(..., donate_argnums=...)``): XLA
writes the new state into the old buffers, and a device holds the parameters
and the optimizer state once at the step boundary instead of twice. An old
array a user kept (``w = model.kernel.value`` before the step, an optimizer's
moment) keeps its value, as under ``nnx.jit``, which does not donate:
:func:`unheld` finds the state leaves something besides their variable holds
(their reference count, one pass over the leaves, about 30 ns each) and
donates a copy of each instead (a device copy, and that leaf held twice for the
step, as without donation). ``distributed_step(fn, donate=False)`` donates
nothing. Arrays passed as pytrees (a Linen ``TrainState``) belong to the user
and are never donated.

One buffer cannot be donated twice, nor donated and passed again in the same
call (XLA refuses both): a state leaf that is the same ``jax.Array`` as another
state leaf (tied weights, a ``device_put`` that returned its input) or as an
array among the other arguments is held twice, so :func:`unheld` donates a copy
of it; any other such leaf (not a ``jax.Array``) is passed undonated.
:func:`split` cuts the state into the donated and the kept leaves;
:func:`assemble`, inside the traced program, puts them back in order.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, repeat
from sys import getrefcount
from typing import Any

import jax
import numpy as np

ALL = "all"  # layout: every state leaf donated
NONE = "none"  # layout: every state leaf kept (donate=False)


def _alone() -> int:
    """What ``getrefcount`` reads, through ``map`` over a list, for an object that
    only that list and one other holder (its variable) hold: measured, as it
    differs between Python versions."""
    holder = {"value": object()}
    return max(map(getrefcount, [holder["value"]]))


ALONE = _alone()


def unheld(state: list) -> list:
    """``state`` (the NNX state leaves, a list that the caller and the variables
    alone hold), with a copy in place of each ``jax.Array`` that something else
    holds as well (the user's ``w = model.kernel.value``, a tied weight, an
    argument of the call): the copy is donated, the held array keeps its value.
    One ``getrefcount`` a leaf when nothing else holds one."""
    if max(map(getrefcount, state), default=0) <= ALONE:
        return state
    counts = list(map(getrefcount, state))  # (read before a new list holds them too)
    return [_copy(x) if n > ALONE and isinstance(x, jax.Array) else x
            for x, n in zip(state, counts)]


def _copy(x: jax.Array) -> jax.Array:
    """A copy of ``x`` in new buffers, with its sharding. In a multi-process job
    each process copies its own shards (a held leaf is held on one process only:
    nothing here may wait for the others)."""
    if x.is_fully_addressable:  # (the sharding named: without it, a PRNG key's copy
        # lands on one device, uncommitted, and the next call compiles again)
        return jax.device_put(x, x.sharding, may_alias=False)
    shards = [jax.device_put(s.data, s.device, may_alias=False) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def split(state: list, others: Any, donate: bool) -> tuple[Any, list, list]:
    """``(layout, donated, kept)``: the state leaves that can be donated and the
    rest; ``layout`` (hashable, a static argument of the program) says which
    list each leaf comes from. ``others`` are the call's other arguments.
    ``state`` must be a list that only the caller holds (:func:`unheld`)."""
    if not donate:
        return NONE, [], state
    return _split(unheld(state), others)


def _split(state: list, others: Any) -> tuple[Any, list, list]:
    if not state:  # (no NNX state, a Linen step: nothing to look for in the others)
        return ALL, state, []
    ids = list(map(id, state))
    shared = set(map(id, _leaves(others)))  # (an id is a state leaf's only if it is one)
    if len(set(ids)) == len(ids) and shared.isdisjoint(ids):
        return ALL, state, []
    counts = Counter(ids)
    layout = tuple(counts[i] == 1 and i not in shared for i in ids)
    donated = [x for x, d in zip(state, layout) if d]
    kept = [x for x, d in zip(state, layout) if not d]
    return layout, donated, kept


def split_flat(state: list, flat: list, donate: bool) -> tuple[Any, list, list]:
    """:func:`split`, for other arguments given as one flat list of arrays and
    scalars (a recalled call's batch and replicated values: ``fleet.step._recall``)."""
    if not donate:
        return NONE, [], state
    state = unheld(state)
    if len(set(map(id, state + flat))) == len(state) + len(flat):
        return ALL, state, []
    return _split(state, [flat])


def _leaves(others: tuple) -> list:
    """The leaves of ``others``, groups (lists) of arguments: the groups' items
    when each is an array or a scalar (a step's usual batch), without flattening
    a tree at every call."""
    items = list(chain.from_iterable(others))
    if all(map(isinstance, items, repeat(_FLAT))):
        return items
    return jax.tree.leaves(others)


_FLAT = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def assemble(layout: Any, donated: list, kept: list) -> list:
    """The state leaves in order, from :func:`split`'s two lists."""
    if layout == ALL:
        return list(donated)
    if layout == NONE:
        return list(kept)
    donated_it, kept_it = iter(donated), iter(kept)
    return [next(donated_it) if d else next(kept_it) for d in layout]


def any_deleted(donated: list) -> bool:
    """Whether a call already consumed (donated) one of these arrays: a failed call
    must not be tried again with them."""
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in donated)
