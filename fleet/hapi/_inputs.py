"""What ``fleet.Model``'s loops accept: datasets, loaders, batches, and their
arguments, checked with messages that say what to pass instead."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import linen, nnx

from fleet._errors import FleetConfigError, FleetError, FleetTypeError
from fleet.hapi._metric import Metric
from fleet.io import DataLoader, DistributedBatchSampler
from fleet.io._sampler_args import int_at_least
from fleet.static import dims
from fleet.wrappers._distributed_optimizer import distributed_optimizer

#: What ``fleet.Model(inputs=...)`` takes, on every supported jax (jax 0.11.1 and
#: later refuse ``jax.ShapeDtypeStruct((None, 784), ...)``: fleet/static.py).
SPEC_EXAMPLE = "fleet.static.InputSpec([None, 784], 'float32', name='x')"

_NEEDS_PREPARE = (
    "call model.prepare(optimizer, loss, metrics) before {what}, e.g. "
    "model.prepare(optax.adam(1e-3), optax.softmax_cross_entropy_with_integer_labels, "
    "fleet.metric.Accuracy())"
)


def check_ready(model: Any, what: str, need_optimizer: bool = False,
                need_loss: bool = False) -> None:
    """``what`` (``fit``, ...) needs ``model.prepare`` to have set these."""
    if need_optimizer and model.optimizer is None:
        raise FleetError(f"{what} needs an optimizer: " + _NEEDS_PREPARE.format(what=what))
    if need_loss and model.loss is None:
        raise FleetError(f"{what} needs a loss: " + _NEEDS_PREPARE.format(what=what))


def check_network(network: Any) -> None:
    """``fleet.Model`` takes an NNX module."""
    if isinstance(network, linen.Module):
        raise FleetTypeError(
            f"fleet.Model takes a Flax NNX module, got the Linen module "
            f"{type(network).__name__}; train Linen with the four-step API "
            "(fleet.distributed_model(module) and its apply in a TrainState, "
            "fleet.distributed_step), or write the network as an NNX module (fleet cannot "
            "wrap a Linen module converted by flax.nnx.bridge.ToNNX yet)"
        )
    if not isinstance(network, nnx.Module):
        raise FleetTypeError(
            f"fleet.Model takes a Flax NNX module (nnx.Module), got {type(network).__name__}"
        )


def check_prepare(network: Any, optimizer: Any, loss: Any, metrics: Any) -> tuple[Any, Any, list]:
    """``Model.prepare``'s arguments, checked: the distributed optimizer (or
    ``None``), the loss, and the metrics as a list."""
    if isinstance(optimizer, nnx.Optimizer):
        optimizer = distributed_optimizer(optimizer)
    elif isinstance(optimizer, (optax.GradientTransformation, optax.MultiSteps)):
        optimizer = distributed_optimizer(nnx.Optimizer(network, optimizer, wrt=nnx.Param))
    elif optimizer is not None:
        raise FleetTypeError(
            f"prepare(optimizer=...) takes an optax transformation (e.g. "
            f"optax.adam(1e-3)) or an nnx.Optimizer, got {type(optimizer).__name__}"
        )
    if loss is not None and not callable(loss):
        raise FleetTypeError(
            f"prepare(loss=...) takes a function loss(outputs, *labels), got "
            f"{type(loss).__name__}; e.g. optax.softmax_cross_entropy_with_integer_labels"
        )
    metrics = [] if metrics is None else [metrics] if isinstance(metrics, Metric) else list(
        metrics)
    for m in metrics:
        if not isinstance(m, Metric):
            raise FleetTypeError(
                f"prepare(metrics=...) takes fleet.metric.Metric objects, got "
                f"{type(m).__name__}; e.g. fleet.metric.Accuracy()"
            )
    names = [n for m in metrics for n in m.name()]
    if len(set(names)) != len(names) or "loss" in names:
        raise FleetConfigError(
            f"metric names {names} repeat (or use 'loss'); give each metric its own "
            "name, e.g. Accuracy(topk=(1, 5), name='acc5')"
        )
    return optimizer, loss, metrics


def count_inputs(network: nnx.Module, inputs: Any) -> int:
    """How many leading sample fields feed the network (``fleet.Model(inputs=...)``)."""
    if inputs is None:
        try:
            signature = inspect.signature(type(network).__call__)
        except (TypeError, ValueError):
            return 1
        required = [p for p in list(signature.parameters.values())[1:]
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and p.default is p.empty]
        return max(len(required), 1)
    if isinstance(inputs, int) and not isinstance(inputs, bool):
        if inputs < 1:
            raise FleetConfigError(f"fleet.Model(inputs={inputs}) must be at least 1")
        return inputs
    if isinstance(inputs, (list, tuple)) and inputs:
        return len(inputs)
    raise FleetTypeError(
        f"fleet.Model(inputs=...) takes the number of inputs or a list of "
        f"fleet.static.InputSpec, one per input; got {inputs!r}"
    )


def input_dims(specs: Sequence[Any]) -> list[tuple[tuple[int | None, ...], Any]]:
    """``(shape, dtype)`` of each ``fleet.Model(inputs=...)`` entry (``None`` for an
    unknown dimension), for ``summary`` and the export; an entry that is no spec, or
    has no batch axis, is refused."""
    known = [dims(s) for s in specs]
    for i, (spec, found) in enumerate(zip(specs, known)):
        if found is None or len(found[0]) < 1:
            raise FleetConfigError(
                f"fleet.Model(inputs=...) entry {i} is {spec!r}; give a fleet.static.InputSpec "
                f"whose first axis is the batch, e.g. {SPEC_EXAMPLE}")
    return known


@contextlib.contextmanager
def loader_for(data: Any, batch_size: int, shuffle: bool, drop_last: bool, num_workers: int,
               what: str, optional: bool = False) -> Iterator[DataLoader | None]:
    """The loader for ``data`` while the block runs: a ``fleet.io.DataLoader`` as it is
    (a caller's own stays open), else one over a ``DistributedBatchSampler``, closed at
    the end; ``None`` for ``optional`` data that is ``None``."""
    if isinstance(data, DataLoader) or (optional and data is None):
        yield data
        return
    if (data is None or isinstance(data, (np.ndarray, jax.Array))
            or not (hasattr(data, "__len__") and hasattr(data, "__getitem__"))):
        raise FleetTypeError(
            f"{what} must be a dataset (a fleet.io.Dataset, or anything with __len__ and "
            f"__getitem__) or a fleet.io.DataLoader, got {type(data).__name__}; wrap arrays "
            "as fleet.io.TensorDataset([x, y])"
        )
    sampler = DistributedBatchSampler(data, batch_size, shuffle=shuffle, drop_last=drop_last)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=num_workers)
    try:
        yield loader
    finally:
        loader.close()


def as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def global_rows(inputs: tuple) -> int:
    first = jax.tree_util.tree_leaves(inputs)[0]
    if isinstance(first, jax.Array):
        return int(first.shape[0])
    return int(np.shape(first)[0]) * jax.process_count()  # process-local numpy rows


def loop_counts(verbose: Any, **counts: Any) -> list[int | None]:
    """A loop's counts, checked: each an int of at least 1 (``num_iters`` may also be
    ``None``), and ``verbose``. Returns the counts as ints, in the order given."""
    checked = [None if name == "num_iters" and value is None else int_at_least(name, value)
               for name, value in counts.items()]
    if verbose not in (0, 1, 2):
        raise FleetConfigError(
            f"verbose={verbose!r} must be 0 (silent), 1 (progress bar) or 2 (one line per "
            "log_freq steps)"
        )
    return checked


def split_batch(batch: Any, num_inputs: int) -> tuple[tuple, tuple]:
    """``(inputs, labels)``: the first ``num_inputs`` fields of a batch, and the rest."""
    if isinstance(batch, dict):
        raise FleetTypeError(
            f"fleet.Model takes samples as tuples (inputs..., labels...), got a dict with "
            f"keys {sorted(batch)}; return a tuple from the dataset's __getitem__"
        )
    fields = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    if len(fields) < num_inputs:
        raise FleetConfigError(
            f"a sample has {len(fields)} fields but the network takes "
            f"{num_inputs} inputs; samples must be (inputs..., labels...), or "
            "pass inputs=N to fleet.Model"
        )
    return fields[:num_inputs], fields[num_inputs:]

