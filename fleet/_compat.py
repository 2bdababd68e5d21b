"""The one door to private symbols of fleet's dependencies.

fleet uses public APIs of jax, flax, optax and orbax wherever they exist. What
has no public form lives here, one function per need, and :func:`check` (run at
import) makes sure each symbol still exists with the shape fleet expects: a
missing or changed one raises :class:`FleetUnsupportedError` naming the
versions fleet supports, instead of a feature going silently off.

(Over 350 lines on purpose: a table, one short function per need and one check.
It is the one door, so one file: the package's root holds only it, the errors and
the public modules (tests/test_layers.py), and two files would be two doors.)

=================================  ========================================================================
need                               private symbol
=================================  ========================================================================
:func:`backends_are_initialized`   ``jax._src.xla_bridge.backends_are_initialized``: JAX can join a job
                                   only before its first computation
:func:`distributed_client`         ``jax._src.distributed.global_state.client``: the key-value store behind
                                   fleet's bounded agreement across processes (``_agree``)
:func:`bind_cpu_collectives`       ``jax._src.lib._jax.make_gloo_tcp_collectives`` and
                                   ``jax._src.xla_bridge.make_cpu_client``: gloo's listeners on the address
                                   the launcher chose (else gloo takes the hostname's, often a loopback
                                   one), registered with JAX's public
                                   ``jax.extend.backend.register_backend_factory``
:func:`is_differentiated`          ``jax._src.interpreters.ad`` ``JVPTracer`` and ``LinearizeTracer``: is a
                                   read inside ``jax.grad``?
:func:`bind_equation`              ``jax.extend.core.JaxprEqn``'s ``ctx.manager`` and
                                   ``Primitive.get_bind_params`` (undocumented members):
                                   ``check_nan_inf``'s replay evaluates a jaxpr
:func:`without_dead_code`          ``jax._src.interpreters.partial_eval.dce_jaxpr``: the probe's program
                                   reduced to what its used outputs need
:func:`user_line`                  an equation's ``source_info.traceback`` (undocumented): the user's line
                                   that made it
:func:`inline_jaxpr`               ``jax._src.interpreters.partial_eval.inline_jaxpr_into_trace``,
                                   ``DynamicJaxprTrace.to_jaxpr_tracer``, ``jax._src.core.trace_ctx`` and
                                   ``jax._src.source_info_util.current``: the probe's program copied into
                                   the real program's trace as it is (an inlined ``jit`` does so)
:func:`threefry`                   ``jax.extend.random.threefry_prng_impl``'s fields (``seed``, ``split``,
                                   ``fold_in``, ``random_bits``): the parts of fleet's row-offset PRNG
                                   (``_random``)
:func:`register_before_exit`       ``threading._register_atexit``: runs when the main thread ends, before
                                   ``concurrent.futures`` stops taking work (an orbax save would die)
:func:`share_fields`               ``nnx.Module``'s ``_pytree__state`` (its own per object) and
                                   ``_pytree__nodes`` (shared): a ``DataParallel`` or distributed optimizer
                                   is a view sharing the wrapped object's fields
:func:`set_class`,                 no private symbol: the one place an object fleet did not create changes
:func:`add_mixin`                  class (a parameter's synced read, a sharded optimizer state, a
                                   recomputed sub-module)
:func:`unfiltered_tracebacks`      ``jax._src.config.traceback_filtering`` as a context manager (this
                                   thread only): a failed trace re-run for its diagnosis keeps JAX's frames
:func:`collective_calls`           no private symbol, an implementation detail: the frames of JAX's public
                                   collectives (``jax.lax.psum`` ...) in a traceback, and the ``axis_name``
                                   argument each holds
:func:`scan_counts`                a ``scan`` equation's consts and carries: its ``num_consts`` /
                                   ``num_carry`` parameters (jax 0.10), or its ``ft_in`` (jax 0.12: a
                                   ``jax._src.flattree.FlatTree``, ``unpack()``)
:func:`to_opt_state`               ``flax.nnx.training.optimizer.to_opt_state``: an optax state as
                                   ``nnx.Optimizer`` holds it (LARS / LAMB swap the inner optimizer)
:func:`handed_graph_cache`         ``flax.nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache``: the graph cache
                                   ``nnx.cached_partial`` hands to the transform it calls (a step enters
                                   NNX's update context to take it, only then: the context costs each call)
:func:`fast_variables`,            ``nnx.Variable``'s ``_raw_value`` and ``_var_metadata``: the step reads
:func:`read_raw`,                  and writes a plain array variable's value without
:func:`write_raw`                  ``Variable.__setattr__``'s trace checks
=================================  ========================================================================
"""

from __future__ import annotations

import functools
import inspect
import os
import sysconfig
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import numpy as np
import optax
from flax import nnx
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src import distributed, source_info_util, xla_bridge
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lib import _jax
from jax.extend import backend as jax_backend
from jax.extend import core as extend_core
from jax.extend import random as _extend_random  # noqa: F401 (jax.extend.random, below)

try:
    from flax.nnx.training.optimizer import to_opt_state as _to_opt_state
except ImportError:  # (check() names it)
    _to_opt_state = None
try:
    from flax.nnx.graphlib import GRAPH_CONTEXT as _GRAPH_CONTEXT
except ImportError:  # (check() names it)
    _GRAPH_CONTEXT = None

from fleet._errors import FleetUnsupportedError

SUPPORTED = (
    "jax 0.10.2 to 0.12.x, flax 0.12.8 to 0.12.x, Python 3.11 to 3.13 (pyproject.toml)")


def backends_are_initialized() -> bool:
    """Whether JAX has started a backend (then it can no longer join a job)."""
    return xla_bridge.backends_are_initialized()


def distributed_client() -> Any:
    """JAX's coordination-service client of this process (its key-value store), once
    ``jax.distributed.initialize`` has run."""
    return distributed.global_state.client


def bind_cpu_collectives(address: str) -> None:
    """Makes the CPU backend's gloo collectives listen on, and tell their peers,
    ``address`` (gloo's own choice is what this machine's hostname resolves to).

    Call it after ``jax.distributed.initialize`` and before JAX's first computation:
    it registers JAX's own CPU client, made with gloo collectives bound to
    ``address``, as the ``cpu`` backend (JAX's public ``register_backend_factory``).
    """
    def factory() -> Any:
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=address)
        return xla_bridge.make_cpu_client(collectives=collectives)

    jax_backend.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def is_differentiated(x: Any) -> bool:
    """Whether ``x`` is being differentiated (a JVP or linearize tracer)."""
    return isinstance(x, (ad.JVPTracer, ad.LinearizeTracer))


def bind_equation(eqn: Any, invals: Sequence) -> Any:
    """One equation of a jaxpr evaluated on ``invals`` as JAX's own ``eval_jaxpr``
    does (``check_nan_inf``'s replay, ``fleet.sections._finite_replay``): its primitive bound with
    its bind parameters (a call's inner jaxpr as a callable), in the equation's
    context (source, compute type). Undocumented members of the public
    ``jax.extend.core.JaxprEqn`` and ``Primitive``: ``ctx.manager``,
    ``get_bind_params``."""
    with eqn.ctx.manager:
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))


def without_dead_code(closed: Any, used_outputs: Sequence[bool]) -> tuple[Any, list[bool]]:
    """``closed`` (a ``ClosedJaxpr``) reduced to the equations its used outputs
    need, and which of its inputs it still reads: JAX's own dead-code
    elimination (``jax._src.interpreters.partial_eval.dce_jaxpr``, which jit runs
    too), used on the probe's program (``fleet.step._first_trace.evaluate``)."""
    jaxpr, used_inputs = _pe.dce_jaxpr(closed.jaxpr, list(used_outputs))
    return closed.replace(jaxpr=jaxpr), list(used_inputs)


def inline_jaxpr(closed: Any, args: Sequence) -> list:
    """``closed`` (a ``ClosedJaxpr``) on ``args``, in the trace that calls it: its
    equations copied into that trace as they are
    (``jax._src.interpreters.partial_eval.inline_jaxpr_into_trace``, what an inlined
    ``jit`` does), without binding each again (``jaxpr_as_fun``: a trace of its
    own). Outside a ``jit`` or ``make_jaxpr`` trace, and under jax's
    ``jax_custom_vjp3`` / ``jax_remat3`` upgrade flags (their traces hold calls that
    only a bind lowers): ``jaxpr_as_fun``."""
    trace = jax_core.trace_ctx.trace
    hi = any(getattr(jax.config, flag, False) for flag in ("jax_custom_vjp3", "jax_remat3"))
    if hi or not isinstance(trace, _pe.DynamicJaxprTrace):
        return extend_core.jaxpr_as_fun(closed)(*args)
    src = source_info_util.current()
    tracers = [trace.to_jaxpr_tracer(x, src) for x in args]
    out = _pe.inline_jaxpr_into_trace(trace, src, closed.jaxpr, closed.consts, *tracers)
    return [trace.to_jaxpr_tracer(x, src) for x in out]


def threefry() -> Any:
    """JAX's threefry PRNG implementation (``jax.extend.random.threefry_prng_impl``)
    with its parts as attributes: ``key_shape``, ``seed``, ``split``, ``fold_in``,
    ``random_bits`` (undocumented fields of the public object), which
    ``fleet.semantics._random`` reuses for its row-offset implementation."""
    return jax.extend.random.threefry_prng_impl


def user_line(eqn: Any) -> str | None:
    """``file:line`` of the innermost frame outside jax, flax, optax, fleet and the
    standard library that made a traced equation (``eqn.source_info.traceback``,
    undocumented), or None."""
    for frame in _frames(eqn):
        if not frame.file_name.startswith(_library_dirs()):
            return f"{frame.file_name}:{frame.line_num}"
    return None


def made_in(eqn: Any, path_end: str) -> bool:
    """Whether a frame of the traceback that made ``eqn`` (as :func:`user_line`
    reads it) is in a file whose path ends with ``path_end``."""
    return any(frame.file_name.endswith(path_end) for frame in _frames(eqn))


def _frames(eqn: Any) -> tuple:
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    return getattr(traceback, "frames", None) or ()


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    here = os.path.dirname(os.path.abspath(__file__))  # fleet itself
    dirs = [os.path.dirname(m.__file__) for m in (jax, flax, optax, _jax)] + [here]
    return tuple(d + os.sep for d in dirs) + (sysconfig.get_paths()["stdlib"] + os.sep, "<")


def unfiltered_tracebacks() -> Any:
    """A context manager (this thread only) under which an exception raised by a
    trace keeps JAX's own frames in its traceback (``JAX_TRACEBACK_FILTERING=off``
    for one call): :func:`collective_calls` reads them."""
    return jax_config.traceback_filtering("off")


#: JAX's public collectives over a named axis, each with an ``axis_name`` parameter.
COLLECTIVES = ("psum", "pmean", "pmax", "pmin", "all_gather", "axis_index", "axis_size",
               "ppermute", "pshuffle", "psum_scatter", "all_to_all", "pbroadcast", "pcast")


def _collective_codes() -> dict:
    return {inspect.unwrap(getattr(jax.lax, n)).__code__: n for n in COLLECTIVES
            if callable(getattr(jax.lax, n, None))}


def collective_calls(tb: Any) -> list[tuple[str, Any, Any]]:
    """``(name, axis_name, caller)`` for each call of a public ``jax.lax``
    collective in the traceback ``tb`` (an unfiltered one: :func:`unfiltered_tracebacks`),
    outermost first: the collective's name, the ``axis_name`` its frame holds
    (what its caller passed) and the caller's frame summary (file, line)."""
    codes = _collective_codes()
    frames = list(traceback.walk_tb(tb))
    out = []
    for i, (frame, _) in enumerate(frames):
        name = codes.get(frame.f_code)
        if name is not None and i > 0 and frames[i - 1][0].f_code not in codes:
            caller, line = frames[i - 1]
            summary = traceback.FrameSummary(caller.f_code.co_filename, line,
                                             caller.f_code.co_name)
            out.append((name, frame.f_locals.get("axis_name"), summary))
    return out


def scan_counts(params: Any) -> tuple[int, int]:
    """``(consts, carries)``: how many of a ``scan`` equation's inputs are its
    constants and its carries (the rest are the scanned inputs; its outputs are
    the carries, then the stacked values)."""
    if "num_consts" in params:  # jax 0.10 and 0.11
        return params["num_consts"], params["num_carry"]
    unpack = getattr(params.get("ft_in"), "unpack", None)  # jax 0.12
    if unpack is None:
        raise FleetUnsupportedError(
            f"this jax ({jax.__version__}) describes a scan with {sorted(params)}, neither "
            f"num_consts / num_carry nor ft_in; fleet supports {SUPPORTED}: install those "
            "versions (pip install -e . picks them)")
    consts, carries, _ = unpack()
    return len(consts), len(carries)


def register_before_exit(fn: Callable[[], None]) -> None:
    """Runs ``fn`` when the main thread ends, before ``atexit``'s hooks and before
    ``concurrent.futures`` refuses new work."""
    threading._register_atexit(fn)


def fast_variables(variables: Sequence[nnx.Variable]) -> bool:
    """Whether every variable holds one jax.Array and no hooks but fleet's read
    hook: then :func:`read_raw` / :func:`write_raw` may skip ``get_raw_value`` /
    ``set_raw_value``."""
    for v in variables:
        metadata = getattr(v, "_var_metadata", None)
        if not (isinstance(getattr(v, "_raw_value", None), jax.Array)
                and isinstance(metadata, dict) and not metadata.get("on_set_value")):
            return False
    return True


def read_raw(variables: Sequence[nnx.Variable]) -> list:
    """Each variable's raw value (variables that passed :func:`fast_variables`)."""
    return [v._raw_value for v in variables]


def write_raw(variables: Sequence[nnx.Variable], values: Sequence) -> None:
    """Sets each variable's raw value, outside any trace (variables that passed
    :func:`fast_variables`)."""
    for v, x in zip(variables, values):
        object.__setattr__(v, "_raw_value", x)


def handed_graph_cache() -> bool:
    """Whether ``nnx.cached_partial`` is handing its graph cache to the transform it
    calls (which takes it by entering ``nnx.update_context``)."""
    return _GRAPH_CONTEXT.tmp_static_cache is not None


def share_fields(view: Any, original: Any) -> None:
    """Makes ``view`` (a new object of a subclass of ``original``'s class) share
    every field of ``original``: its attributes and variables, and Flax's record
    of which attributes are data (``_pytree__nodes``, an immutable mapping: what
    the view adds later replaces the view's own), but not Flax's per-object state
    (``_pytree__state``), which ``view`` has of its own. ``fleet.DataParallel``
    and ``DistributedOptimizer`` are such views."""
    for name, value in vars(original).items():
        if name != "_pytree__state":
            object.__setattr__(view, name, value)


_MIXED_TYPES: dict[tuple[type, type], type] = {}


def set_class(obj: Any, cls: type) -> None:
    """Makes ``obj`` an instance of ``cls``, a subclass of its own class (or back a
    base class it had), in place.

    The one place where fleet changes the class of an object it did not create
    (``isinstance`` of the old class still holds):

    * a wrapped model's parameters become ``Synced…`` (:func:`add_mixin`): their
      reads inside a step are the bucket-synced values. Flax's own route for a
      read hook, ``on_get_value`` metadata, is deprecated in favour of a Variable
      type of one's own; the variables must stay the very objects the model, its
      ``DataParallel`` view and any optimizer built on it share, so their type
      changes where they are;
    * a sharded optimizer's state variables become ``Sharded…`` (:func:`add_mixin`);
    * a metric inside a step's trace becomes ``Global…`` (``fleet/semantics/_metrics.py``), and
      its class is put back (a base class of its own) before the graph is split;
    * a recomputed sub-module becomes ``Recompute…`` (``fleet/sections/_recompute.py``):
      Python calls a module through its type, and a wrapper module would change
      the state's paths.
    """
    if not (issubclass(cls, type(obj)) or cls in type(obj).__mro__):
        raise TypeError(f"{cls.__name__} is neither a subclass nor a base class of "
                        f"{type(obj).__name__}")
    object.__setattr__(obj, "__class__", cls)  # (not through an NNX object's bookkeeping)


def add_mixin(variable: nnx.Variable, mixin: type, prefix: str) -> None:
    """Gives a variable ``mixin`` in place (:func:`set_class`): its class becomes
    a subclass of ``mixin`` and of its own class (``isinstance`` holds for both),
    named ``prefix`` + its class name, made once per class."""
    cls = type(variable)
    if not issubclass(cls, mixin):
        mixed = _MIXED_TYPES.get((mixin, cls))
        if mixed is None:
            mixed = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__slots__": ()})
            _MIXED_TYPES[(mixin, cls)] = mixed
        set_class(variable, mixed)


def to_opt_state(tree: Any) -> Any:
    """An optax state as ``nnx.Optimizer`` keeps it (its arrays wrapped as
    ``nnx.OptState`` variables): ``flax.nnx.training.optimizer.to_opt_state``,
    which ``nnx`` does not export."""
    return _to_opt_state(tree)


def check() -> None:
    """Raises :class:`FleetUnsupportedError` if a symbol above is gone or changed."""
    missing = [f"{where}.{name}" for owner, where, name in (
        (xla_bridge, "jax._src.xla_bridge", "backends_are_initialized"),
        (_jax, "jax._src.lib._jax", "make_gloo_tcp_collectives"),
        (extend_core.Primitive, "jax.extend.core.Primitive", "get_bind_params"),
        (jax.extend.random, "jax.extend.random", "define_prng_impl"),
        (_pe, "jax._src.interpreters.partial_eval", "dce_jaxpr"),
        (_pe, "jax._src.interpreters.partial_eval", "inline_jaxpr_into_trace"),
        (getattr(_pe, "DynamicJaxprTrace", None), "jax._src.interpreters.partial_eval."
         "DynamicJaxprTrace", "to_jaxpr_tracer"),
        (source_info_util, "jax._src.source_info_util", "current"),
        (jax_config, "jax._src.config", "traceback_filtering"),
        (threading, "threading", "_register_atexit"),
    ) if not callable(getattr(owner, name, None))]
    if not hasattr(getattr(jax_core, "trace_ctx", None), "trace"):
        missing.append("jax._src.core.trace_ctx.trace")
    if not hasattr(getattr(distributed, "global_state", None), "client"):
        missing.append("jax._src.distributed.global_state.client")
    make_cpu_client = getattr(xla_bridge, "make_cpu_client", None)
    if not callable(make_cpu_client) or "collectives" not in inspect.signature(
            make_cpu_client).parameters:
        missing.append("jax._src.xla_bridge.make_cpu_client(collectives=)")
    for name in ("JVPTracer", "LinearizeTracer"):
        if not isinstance(getattr(ad, name, None), type):
            missing.append(f"jax._src.interpreters.ad.{name}")
    if "ctx" not in getattr(extend_core.JaxprEqn, "__dataclass_fields__", vars(
            extend_core.JaxprEqn)) or not hasattr(jax_core.JaxprEqnContext, "manager"):
        missing.append("jax.extend.core.JaxprEqn.ctx.manager")
    fry = getattr(jax.extend.random, "threefry_prng_impl", None)
    if getattr(fry, "key_shape", None) != (2,) or not all(
            callable(getattr(fry, f, None)) for f in ("seed", "split", "fold_in", "random_bits")):
        missing.append("jax.extend.random.threefry_prng_impl's key_shape, seed, split, "
                       "fold_in, random_bits")
    for name in COLLECTIVES:
        fn = getattr(jax.lax, name, None)
        if not callable(fn) or not hasattr(inspect.unwrap(fn), "__code__") or (
                "axis_name" not in inspect.signature(fn).parameters):
            missing.append(f"jax.lax.{name}(axis_name=)")
    probe = nnx.Param(np.zeros(()))  # numpy: importing fleet computes nothing
    if not isinstance(getattr(probe, "_raw_value", None), np.ndarray) or not isinstance(
            getattr(probe, "_var_metadata", None), dict):
        missing.append("flax.nnx.Variable._raw_value / _var_metadata")
    if not callable(_to_opt_state):
        missing.append("flax.nnx.training.optimizer.to_opt_state")
    if "tmp_static_cache" not in getattr(type(_GRAPH_CONTEXT), "__dataclass_fields__", ()):
        missing.append("flax.nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache")
    fields = vars(nnx.Module())
    if "_pytree__state" not in fields or "_pytree__nodes" not in fields:
        missing.append("flax.nnx.Module's _pytree__state / _pytree__nodes")
    if missing:
        raise FleetUnsupportedError(
            f"this installation lacks what fleet needs from its dependencies: "
            f"{', '.join(missing)} (jax {jax.__version__}); fleet supports {SUPPORTED}: "
            "install those versions (pip install -e . picks them)"
        )


check()
