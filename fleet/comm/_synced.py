"""A wrapped model's parameter: its type, and how a read inside a step reaches
fleet's gradient sync (:mod:`fleet.comm._sync`).

Wrapping a model (``fleet.distributed_model``) turns each ``nnx.Param`` into a
subclass of its own class and of :class:`SyncedRead` (``isinstance(p,
nnx.Param)`` still holds), carrying a :class:`SyncSpec`. Inside a step its
model's ``__call__`` syncs every parameter at once, in buckets
(:func:`bucketed_call`); a read elsewhere syncs that one leaf. Under ZeRO stage 3
(``spec.layout``) the parameter holds its replicas' slices: a read gathers it,
inside a step or out (:mod:`fleet.comm._param_gather`), and a write outside a
step splits it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from flax import nnx
from flax.errors import TraceContextError
from flax.typing import MISSING, Missing

from fleet import _compat
from fleet._compat import is_differentiated
from fleet._errors import FleetError
from fleet.comm._buckets import BucketConfig
from fleet.comm._shard_comm import to_logical, to_shards
from fleet.comm._sync import current, fleet_written, is_varying, sync_leaves
from fleet.comm._trace import SyncTrace


def raw_read_hint(what: str) -> str:
    """What a refusal adds under stage 3, where ``what`` (an output, the loss) may
    read a parameter's raw value: the replica's slice, where ``variable[...]``
    reads the whole parameter (gathered)."""
    return ("Under sharding_configs.stage = 3 a parameter's raw value in the step "
            "(jax.tree.leaves(nnx.state(model)), optax.tree.norm(nnx.state(model, "
            f"nnx.Param))) is this replica's slice: if {what} reads one, read "
            "variable[...] instead, which fleet gathers whole")


@dataclasses.dataclass(frozen=True, eq=False)
class SyncSpec:
    """What a wrapped NNX model's parameter carries (variable metadata
    ``fleet_sync``): its name for the accumulator, and its model's buckets.

    Two specs that differ only in ``key`` compare equal, as two same-shaped
    parameters' metadata do on one device: JAX compares a variable's metadata
    when it matches two trees (``optax.incremental_update`` of a target
    network's state towards the online one's, ``jax.lax.cond`` choosing
    between them), and ``nnx.update`` keeps a variable's own metadata where
    the new one compares equal.

    Inside a model's call in a step they differ where it matters to a write:
    JAX reuses a transformation's trace for equal inputs, and skips the Python
    of a reused trace, where fleet learns of a write into a copy
    (:meth:`SyncedRead.set_value`: ``nnx.SpectralNorm`` through ``nnx.remat``,
    ``nnx.jit``, tests/test_written_params.py). So each call's specs carry that
    call's token (:func:`bucketed_call`): no trace made elsewhere (the
    single-device reference, an earlier step or call) is reused inside it. And
    two parameters one of which the call wrote compare unequal: one
    ``nnx.remat`` called on two same-shaped layers traces the second anew.
    """

    key: str
    buckets: BucketConfig
    #: stage 3 (``sharding_configs.stage = 3``): how the parameter is split
    #: (a fleet.comm._shard_comm.Layout; its value is the replicas' slices)
    layout: Any = None
    #: the wrapped model's call in a step that holds this copy (bucketed_call)
    call: Any = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SyncSpec):
            return NotImplemented
        if (self.buckets, self.layout, self.call) != (other.buckets, other.layout, other.call):
            return False
        trace = current()
        return (self.key == other.key or trace is None
                or not {self.key, other.key} & trace.writes)

    def __hash__(self) -> int:  # (equal specs: equal buckets, layouts and calls)
        return hash((self.buckets, self.layout, self.call))


class SyncedRead:
    """Mixin of a wrapped NNX model's parameter types (``SyncedParam``).

    Outside a step, or where the value is not being differentiated (the
    optimizer's update, a hand-written SGD), a read returns the value itself.
    Inside the model's ``__call__`` the raw value is the bucket-synced one
    already (:func:`bucketed_call`: varying, returned as it is); elsewhere under
    differentiation a read syncs this one leaf.
    """

    __slots__ = ()

    def get_value(self, *, index: Any = MISSING) -> Any:
        trace = current()
        spec = self.get_metadata("fleet_sync", None)  # (None: a copy being built)
        raw = self.get_raw_value()
        if spec is None:
            return super().get_value(index=index)
        if spec.layout is not None:  # stage 3: whole, gathered inside a step
            if trace is None:  # (a tree mapped over the state holds other values)
                if getattr(raw, "shape", None) != (spec.layout.replicas, spec.layout.chunk):
                    return super().get_value(index=index)
                return _indexed(to_logical(raw, spec.layout), index)
            if not _whole(raw, spec.layout, trace):
                return _indexed(sync_leaves([spec.key], [raw], spec.buckets, [spec.layout])[0],
                                index)
        elif trace is not None and is_differentiated(raw) and not is_varying(raw):
            return _indexed(sync_leaves([spec.key], [raw], spec.buckets)[0], index)
        return super().get_value(index=index)

    def set_value(self, value: Any, *, index: Any = MISSING) -> None:
        spec = self.get_metadata("fleet_sync", None)
        trace = current()
        if trace is not None and spec is not None:  # (kept: bucketed_call; by name, as
            trace.writes.add(spec.key)  # nnx.remat, nnx.jit and nnx.scan write into a copy)
        if spec is None or spec.layout is None or trace is not None:
            return super().set_value(value, index=index)
        whole = value
        if not (isinstance(index, Missing) or index is ...):
            whole = to_logical(self.get_raw_value(), spec.layout).at[index].set(value)
        return self.set_raw_value(to_shards(whole, spec.layout))


def layout_of(variable: Any) -> Any:
    """Stage 3's layout of a wrapped parameter (``None``: whole, or not wrapped; a
    parameter of a synced type made by hand carries no spec)."""
    spec = variable.get_metadata("fleet_sync", None) if isinstance(variable, SyncedRead) else None
    return None if spec is None else spec.layout


def _whole(raw: Any, layout: Any, trace: SyncTrace) -> bool:
    """Whether a stage-3 parameter's value inside a step is whole (gathered: by
    its shape, or where a slice has the same shape, a value gathered here)."""
    if raw.shape != layout.shape:
        return False
    return raw.shape != (layout.chunk,) or id(raw) in trace.shard.whole


def _indexed(value: Any, index: Any) -> Any:
    return value if isinstance(index, Missing) or index is ... else value[index]


@contextlib.contextmanager
def synced_as_raw(module: Any) -> Iterator[None]:
    """Inside a step, around a transformed call of a sub-module (``nnx.remat``,
    ``nnx.jit``): its wrapped parameters hold their synced values as raw values,
    read here, outside the transformation, so the gradient reduction stays in
    fleet's sync; restored after."""
    params = [v for _, v in nnx.iter_graph(module) if isinstance(v, SyncedRead)]
    raw = [v.get_raw_value() for v in params]
    for v in params:
        v.set_raw_value(v.get_value())
    try:
        yield
    finally:
        for v, r in zip(params, raw):
            v.set_raw_value(r)


def make_synced(variable: Any, spec: SyncSpec) -> None:
    """Turns a parameter into its synced type, in place (see :class:`SyncedRead`;
    :func:`fleet._compat.add_mixin` says why in place)."""
    _compat.add_mixin(variable, SyncedRead, "Synced")
    variable.set_metadata("fleet_sync", spec)


@contextlib.contextmanager
def bucketed_call(variables: dict, buckets: BucketConfig) -> Iterator[None]:
    """Around a wrapped NNX model's ``__call__``: syncs every differentiated
    parameter at once, in buckets, and lets the parameters hold their synced
    values as raw values for the call (restored after). So every read inside
    the call sees the synced value, also where a transformation inside the
    model reads the raw values itself: ``nnx.scan`` over stacked layers,
    ``nnx.vmap``, ``nnx.remat``, ``nnx.jit`` extract the state outside their
    body, and a parameter that entered them unsynced would be read inside as an
    invariant value that JAX casts to varying, whose transpose *sums* the
    gradient over the replicas (tests/test_scan.py)."""
    trace = current()
    if trace is None:
        yield
        return
    keys = list(variables)
    raw = [variables[k].get_raw_value() for k in keys]
    if keys and not _writable(variables[keys[0]], raw[0]):
        with _foreign(trace):
            yield
        return
    layouts = [layout_of(variables[k]) for k in keys]
    synced = sync_leaves(keys, raw, buckets, layouts)
    changed = [(k, variables[k], r, s) for k, r, s in zip(keys, raw, synced) if s is not r]
    for k, v, _, s in changed:
        v.set_raw_value(s)
        trace.writes.discard(k)
    specs = {k: spec for k in keys  # (None: a parameter added since the wrapping)
             if (spec := variables[k].get_metadata("fleet_sync", None)) is not None}
    token = object()  # (this call's: SyncSpec)
    for k, spec in specs.items():
        variables[k].set_metadata("fleet_sync", dataclasses.replace(spec, call=token))
    try:
        yield
    finally:
        for k, spec in specs.items():
            variables[k].set_metadata("fleet_sync", spec)
        for k, v, r, s in changed:
            written = v.get_raw_value()
            # The call wrote it (``variable[...] = x``, ``set_value``: nnx.SpectralNorm's
            # normalised kernel): kept, as on one device. A transformation that
            # set the same value back (nnx.scan's state) is restored.
            if written is not s and k in trace.writes:
                v.set_raw_value(_kept_write(trace, k, v, written))
            else:
                v.set_raw_value(r)


def _kept_write(trace: SyncTrace, key: str, variable: Any, written: Any) -> Any:
    """What a wrapped model's call wrote into parameter ``key``, for the rest of the
    step: the same value on every replica (:func:`fleet.comm._sync.fleet_written`)."""
    if layout_of(variable) is not None:
        raise FleetError(
            f"the model's call wrote its parameter {key!r} (nnx.SpectralNorm writes the "
            "normalised kernel): under sharding_configs.stage = 3 each replica holds a "
            "slice of it, and fleet cannot keep a write of the whole parameter; use stage "
            "2 or lower, or a layer that reads its parameters without writing them")
    trace.written.append(_WRITTEN.format(name=key))
    return fleet_written(written)


_WRITTEN = (
    "the model's call wrote its parameter {name!r} from values that differ across "
    "replicas (computed from the batch?): each replica would keep its own value, "
    "where the single-device step keeps one. Write the parameter from parameters and "
    "replicated state alone (as nnx.SpectralNorm writes its normalised kernel), or keep "
    "a statistic of the batch in a state variable of its own (an nnx.BatchStat), "
    "combined over the replicas in the step as on one device: "
    "fleet.all_reduce(value, 'avg') for a mean")


def _writable(variable: Any, raw: Any) -> bool:
    """Whether this trace may write the model's variables (Flax lets only the
    model's own: not a JAX transformation that closes over it)."""
    try:
        variable.set_raw_value(raw)  # (the value it holds: nothing changes)
    except TraceContextError:
        return False
    return True


@contextlib.contextmanager
def _foreign(trace: SyncTrace) -> Iterator[None]:
    """A wrapped model's call inside a JAX transformation that closes over it: each
    read syncs itself (:meth:`SyncedRead.get_value`), once per parameter in this
    call, in this transformation's trace; those values cannot leave it, so the
    step's own syncs are set aside meanwhile. A parameter read here and in the
    step is synced twice (:meth:`fleet.comm._trace.SyncTrace.twice`)."""
    outer, trace.synced = trace.synced, {}
    trace.foreign += 1
    try:
        yield
    finally:
        trace.foreign -= 1
        trace.synced = outer
