"""What a refusal of the single-device step adds when the step's arguments explain it.

The single-device check (:func:`fleet.step._guards.check_on_one_device`) refuses a
step that fails on one device too, with JAX's or Flax's own error. Two causes
come from how the step was given its arguments, and their errors do not say so:

* NNX objects read from outside the step's arguments (a closure, a global,
  ``functools.partial`` or ``nnx.cached_partial`` around the step): a traced
  step updates only the objects it is given, as under ``nnx.jit``, and Flax
  raises "Cannot extract graph node from different trace level"
  (:func:`with_bound_hint`);
* a Python scalar argument used in Python control flow (``if train:``): it is
  traced, as under ``jax.jit``, and JAX raises ``TracerBoolConversionError``
  (:func:`traced_scalars`); ``static_argnames`` makes it static.

:func:`outside_values` is the one walk of what a step reads from outside its
arguments: the NNX objects here, the split arrays ``fleet.step._guards.check_closures``
refuses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx

from fleet._errors import FleetError, nth


def parameter_names(fn: Callable) -> list[str]:
    """The positional parameters' names of ``fn`` (none where it has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def scalar_names(fn: Callable, kinds: Sequence[str], kw_names: Sequence[str],
                 scalar_kind: str) -> list[str]:
    """A call's arguments of ``scalar_kind`` (its replicated, traced scalars), by
    name where ``fn``'s signature has one: ``train (the 5th argument)``."""
    n_pos = len(kinds) - len(kw_names)
    params = parameter_names(fn)
    return [(f"{params[i]} ({nth(i)})" if i < len(params) else nth(i)) if i < n_pos
            else kw_names[i - n_pos]
            for i, k in enumerate(kinds) if k == scalar_kind]


def traced_scalars(error: Exception, scalars: Sequence[str]) -> str:
    """For ``error``, a traced value where Python needs a concrete one (``if``,
    ``int()``), in a step with scalar arguments: that they are traced, and
    how to make one static. Empty otherwise."""
    concrete = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)
    if not scalars or not isinstance(error, concrete):
        return ""
    return (f". The step's scalar arguments are traced, as under jax.jit: "
            f"{', '.join(scalars)}. To branch on one in Python (if train:), declare it "
            "static, as jax.jit's static_argnames: fleet.distributed_step(fn, "
            "static_argnames=(...)) or static_argnums=(...); each value then gets a "
            "program of its own")


def outside_values(fn: Any) -> Iterator[tuple[str, Any, bool]]:
    """What a step reads from outside its arguments, as ``(name, value, closed)``:
    the values ``functools.partial`` binds (``closed`` false), then the globals and
    nonlocals its function closes over (``closed`` true), through every wrapper
    (``.func``, ``__wrapped__``)."""
    while True:
        for i, value in enumerate(getattr(fn, "args", ())):  # functools.partial
            yield f"functools.partial's argument {i + 1}", value, False
        for name, value in (getattr(fn, "keywords", None) or {}).items():
            yield f"functools.partial's {name}=", value, False
        try:
            closure = inspect.getclosurevars(fn)
        except TypeError:  # (a callable object, a builtin)
            closure = None
        for name, value in ({} if closure is None else
                            {**closure.globals, **closure.nonlocals}).items():
            yield repr(name), value, True
        fn = getattr(fn, "func", getattr(fn, "__wrapped__", None))
        if fn is None:
            return


def bound_objects(fn: Any) -> list[str]:
    """The NNX objects a step reads from outside its arguments
    (:func:`outside_values`: bound by ``functools.partial``, or ``nnx.cached_partial``
    inside the step, or closed over); each named with its class."""
    found, seen = [], set()
    for name, value, closed in outside_values(fn):
        items = [(name, value)] + [  # (a tuple: the objects nnx.cached_partial binds)
            (f"{name}[{j}]", leaf) for j, leaf in enumerate(
                value if closed and isinstance(value, tuple) else ())]
        for where, x in items:
            if isinstance(x, (nnx.Module, nnx.Optimizer)) and id(x) not in seen:
                seen.add(id(x))
                found.append(f"{where} ({type(x).__name__})")
    return found


def with_bound_hint(error: FleetError, fn: Any) -> FleetError:
    """``error`` (the single-device step's), with a hint when the step reads NNX
    objects from outside its arguments (:func:`bound_objects`), which a traced
    step cannot update, under nnx.jit as here."""
    bound = bound_objects(fn)
    if not bound:
        return error
    hint = (f". The step reads {', '.join(bound)} from outside its arguments: a traced step "
            "updates only the NNX objects it is given, under nnx.jit as here. Pass them: "
            "step(model, optimizer, x, y); to bind them once, bind the fleet step: "
            "nnx.cached_partial(fleet.distributed_step(train_step), model, optimizer)")
    return type(error)(str(error) + hint).with_traceback(error.__traceback__)
