"""Flax metrics updated inside a step: each update sees the global batch.

A step that updates an ``nnx.metrics`` metric (``Average``, ``Accuracy``,
``Welford``, ``MultiMetric``, or any ``nnx.metrics.Metric`` subclass) runs once
per replica, on the replica's rows. Left alone, each replica would add its own
rows to the metric's totals and counts: the counts come out the replica's (a
static ``values.size``), and a float total, written from per-replica values,
would be averaged over the replicas like a buffer -- ``compute()`` a right
ratio over wrong state. Welford's variance cannot be merged that way at all.

fleet does what the single-device step does instead: it calls the metric's own
``update`` with the *global* batch's values. Inside a step each metric object of
the step's arguments answers ``update`` through a subclass of its own class
(``Global<its class>``, put back before the graph is split again), which
turns every argument into its single-device value and then calls the metric's
own ``update``:

* an array per example (leading axis = the replica's batch rows: logits,
  labels, a mask) is gathered from every replica, in global batch order
  (``jax.lax.all_gather`` typed invariant: one all-gather of the metric's
  inputs per update);
* a scalar that differs per replica (a mean loss, a count of correct rows, a
  maximum error) becomes what the single-device step computes from the global
  batch: its mean, sum, maximum or minimum over the replicas, after the
  reduction over the batch rows that made it. fleet reads that reduction from
  the traced step as it does for a step's scalar outputs (``fleet.semantics._outputs``,
  ``metric_reduces``): ``.mean()`` is a mean, ``.sum()`` (a float sum too) a
  sum, ``jnp.max`` a maximum. A scalar that is none of these (a standard
  deviation, a ratio of two sums) is refused, naming the metric and the
  argument: pass per-example values, or combine it over the replicas yourself
  (``fleet.all_reduce``);
* a value the same on every replica is used as it is.

*How*: the probe traces of the step (``fleet.step._program``) pass each such scalar
through a call of its own, ``fleet_metric_<k>`` (the k-th in the trace, typed
the same on every replica: a global value for ``fleet.semantics._outputs.check_counted``),
so the per-replica probe and the single-device reference can be read side by
side; the real trace combines the k-th scalar by the k-th kind recorded.

The update then runs on the same global values on every replica: the metric's
state -- totals, counts, Welford's mean and ``m2`` -- ends the step as the
single-device metric's does, and the same on every replica. Anything else that
differs per replica (an array that is neither per example nor a scalar) is
refused, naming the metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet import _compat
from fleet._errors import FleetError, batch_rows, nth
from fleet.comm import _sync
from fleet.runtime._leaves import dotted
from fleet.runtime._world import DATA_AXIS


@dataclasses.dataclass
class Updates:
    """The metric updates of one trace of a step body: the batch's ``rows``;
    ``kinds``, how the k-th varying scalar combines (the real trace), or ``None``
    (a probe: each scalar goes through its marked call, ``labels`` says whose)."""

    rows: frozenset
    kinds: list | None
    labels: list = dataclasses.field(default_factory=list)
    #: how the probe combined each (its guess: a float's mean, else a sum)
    assumed: list = dataclasses.field(default_factory=list)
    done: int = 0  # the scalars combined so far (the real trace)


def _update(self: Any, *args: Any, **kwargs: Any) -> None:
    """A metric's ``update`` inside a step: with global values (see the module
    docstring), then the metric's own."""
    base = type(self).__fleet_base__
    trace = _sync.current()
    updates = None if trace is None else trace.metrics
    if updates is not None:
        args, kwargs = jax.tree_util.tree_map_with_path(
            lambda p, x: _global(x, updates, base.__name__, _argument(p)), (args, kwargs))
    return base.update(self, *args, **kwargs)


def _argument(path: tuple) -> str:
    """An update's argument, from its path in ``(args, kwargs)``."""
    where, key, rest = path[0].idx, path[1], dotted(path[2:])
    name = f"argument {key.key!r}" if where else nth(key.idx)
    return name + (f" (leaf {rest})" if rest else "")


def _global(x: Any, updates: Updates, metric: str, argument: str) -> Any:
    if not isinstance(x, jax.Array) or not _sync.is_varying(x):
        return x
    if x.ndim == 0:
        return _scalar(x, updates, f"{metric} ({argument})")
    if x.shape[0] in updates.rows:
        return fleet_gather(x)
    raise FleetError(
        f"the step updates metric {metric} with a value of shape {x.shape} for "
        f"{batch_rows(updates.rows)} that differs across "
        "replicas and is neither per example (its leading axis the batch rows) nor a "
        "scalar, so fleet cannot give the metric the "
        "single-device value. Pass per-example values (logits, labels, per-example losses) "
        "or a scalar mean")


def _scalar(x: jax.Array, updates: Updates, label: str) -> jax.Array:
    """A varying scalar: marked (a probe) or combined by its recorded kind."""
    if updates.kinds is None:
        updates.labels.append(label)
        updates.assumed.append("mean" if jnp.issubdtype(x.dtype, jnp.inexact)
                               else "sum")
        return _marker(len(updates.labels) - 1, updates.assumed[-1])(x)
    if updates.done >= len(updates.kinds):
        raise FleetError(
            f"the step updated metric {label} with one more scalar than when fleet probed it "
            "(its metric updates depend on something other than its arguments' shapes)")
    kind = updates.kinds[updates.done]
    updates.done += 1
    return COMBINE[kind](x)


#: The prefix of the probe's calls around the scalars metrics get (fleet.semantics._outputs).
METRIC_CALL = "fleet_metric_"


def mark_name(k: int) -> str:
    """The name of the probe's call around the k-th varying scalar a metric gets."""
    return f"{METRIC_CALL}{k}"


@functools.cache
def _marker(k: int, kind: str) -> Any:
    def marked(x: jax.Array) -> jax.Array:  # (the probe's program is the real one if so decided)
        return COMBINE[kind](x)

    marked.__name__ = marked.__qualname__ = mark_name(k)
    return jax.jit(marked)


@jax.jit
def fleet_pmax(x: jax.Array) -> jax.Array:
    return jax.lax.pmax(x, DATA_AXIS)


@jax.jit
def fleet_pmin(x: jax.Array) -> jax.Array:
    return jax.lax.pmin(x, DATA_AXIS)


#: How a metric's varying scalar of each kind (fleet.semantics._outputs.metric_reduces)
#: becomes the global value, the same on every replica.
COMBINE = {"mean": lambda x: _sync.fleet_pmean(x)[0], "sum": lambda x: _sync.psum([x])[0],
           "max": fleet_pmax, "min": fleet_pmin}


@jax.jit
def fleet_gather(x: jax.Array) -> jax.Array:
    """The replicas' rows of ``x`` in global batch order, the same on every replica."""
    return jax.lax.all_gather(x, DATA_AXIS, axis=0, tiled=True, to="invarying")


@contextlib.contextmanager
def global_updates(trace: _sync.SyncTrace, objs: Any, rows: frozenset, record: Any,
                   probe: bool) -> Iterator[None]:
    """Inside a step's ``trace``: the metrics among ``objs`` (NNX objects and their
    sub-objects) update with global values; their classes are put back after,
    before the graph is split again. A probe records in ``record.metric_labels``
    which metric got each varying scalar; the real trace combines them by
    ``record.metric_scalars`` (fleet.step._probe_checks.resolve_metrics)."""
    metrics = [node for _, node in nnx.iter_graph(objs) if isinstance(node, nnx.metrics.Metric)
               and getattr(type(node), "__fleet_base__", None) is None]
    if not metrics:
        yield
        return
    classes = [type(m) for m in metrics]
    for m in metrics:
        _compat.set_class(m, _global_class(type(m)))
    updates = Updates(rows, None if probe else record.metric_scalars)
    if probe:
        record.metric_labels, record.metric_assumed = updates.labels, updates.assumed
    outer, trace.metrics = trace.metrics, updates  # (the trace's: fleet.comm._trace)
    try:
        yield
    finally:
        trace.metrics = outer
        for m, cls in zip(metrics, classes):
            _compat.set_class(m, cls)


_CLASSES: dict[type, type] = {}


def _global_class(cls: type) -> type:
    mixed = _CLASSES.get(cls)
    if mixed is None:
        mixed = _CLASSES[cls] = type(f"Global{cls.__name__}", (cls,), {
            "update": _update, "__fleet_base__": cls})
    return mixed
