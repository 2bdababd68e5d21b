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
* a floating-point scalar that differs per replica (a mean loss) becomes its
  mean over the replicas, the global-batch value of a mean; an integer or
  boolean one its sum. (Unlike a step's outputs, whose reduction fleet reads
  from the traced step, a metric's scalar is taken as a mean at the update: a
  float *sum* passed to a metric is not told apart. Pass per-example values.)
* a value the same on every replica is used as it is.

The update then runs on the same global values on every replica: the metric's
state -- totals, counts, Welford's mean and ``m2`` -- ends the step as the
single-device metric's does, and the same on every replica. Anything else that
differs per replica (an array that is neither per example nor a scalar) is
refused, naming the metric.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet import _compat, _sync
from fleet._errors import FleetError
from fleet._world import DATA_AXIS


def _update(self: Any, *args: Any, **kwargs: Any) -> None:
    """A metric's ``update`` inside a step: with global values (see the module
    docstring), then the metric's own."""
    base = type(self).__fleet_base__
    rows = _local.rows[-1] if getattr(_local, "rows", None) else None
    if rows is not None:
        args, kwargs = jax.tree.map(lambda x: _global(x, rows, base.__name__), (args, kwargs))
    return base.update(self, *args, **kwargs)


_local = threading.local()  # .rows: a stack of the batch rows of the steps being traced


def _global(x: Any, rows: frozenset, metric: str) -> Any:
    if not isinstance(x, jax.Array) or not _sync.is_varying(x):
        return x
    if x.ndim == 0:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return _sync.fleet_pmean(x)[0]
        return _sync.psum([x])[0]
    if x.shape[0] in rows:
        return fleet_gather(x)
    raise FleetError(
        f"the step updates metric {metric} with a value of shape {x.shape} per replica that "
        "differs across replicas and is neither per example (leading axis = the replica's "
        f"{sorted(rows)} batch rows) nor a scalar, so fleet cannot give the metric the "
        "single-device value. Pass per-example values (logits, labels, per-example losses) "
        "or a scalar mean")


@jax.jit
def fleet_gather(x: jax.Array) -> jax.Array:
    """The replicas' rows of ``x`` in global batch order, the same on every replica."""
    return jax.lax.all_gather(x, DATA_AXIS, axis=0, tiled=True, to="invarying")


@contextlib.contextmanager
def global_updates(objs: Any, rows: frozenset) -> Iterator[None]:
    """Inside a step's trace: the metrics among ``objs`` (NNX objects and their
    sub-objects) update with global values; their classes are put back after,
    before the graph is split again."""
    metrics = [node for _, node in nnx.iter_graph(objs) if isinstance(node, nnx.metrics.Metric)
               and getattr(type(node), "__fleet_base__", None) is None]
    if not metrics:
        yield
        return
    classes = [type(m) for m in metrics]
    for m in metrics:
        _compat.set_class(m, _global_class(type(m)))
    stack = _local.__dict__.setdefault("rows", [])
    stack.append(rows)
    try:
        yield
    finally:
        stack.pop()
        for m, cls in zip(metrics, classes):
            _compat.set_class(m, cls)


_CLASSES: dict[type, type] = {}


def _global_class(cls: type) -> type:
    mixed = _CLASSES.get(cls)
    if mixed is None:
        mixed = _CLASSES[cls] = type(f"Global{cls.__name__}", (cls,), {
            "update": _update, "__fleet_base__": cls})
    return mixed
