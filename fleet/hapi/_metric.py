"""Metrics for :class:`fleet.Model`: Paddle's ``paddle.metric`` in two halves.

A metric is split where the device ends and the host begins:

* :meth:`Metric.compute` runs **inside** the distributed step, on each replica's
  rows, and returns *per-example* arrays (leading axis = the batch). The step
  gathers them in global batch order;
* :meth:`Metric.update` runs **on the host** with those rows, after the padding
  rows the sampler repeated have been dropped, and accumulates counts.

So a metric sees every sample of an evaluation set exactly once, whatever the
number of replicas and processes, and :meth:`Metric.accumulate` returns the value
one device computes on the whole set.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fleet._errors import FleetConfigError, FleetTypeError, FleetUnsupportedError


class Metric(abc.ABC):
    """Base class of metrics (Paddle's ``paddle.metric.Metric``).

    Subclasses define :meth:`update`, :meth:`accumulate`, :meth:`reset` and
    :meth:`name`; :meth:`compute` (traced, on device) defaults to passing the
    outputs and labels through.

    Example:
        >>> import numpy as np
        >>> class MeanAbsError(Metric):
        ...     def __init__(self):
        ...         self.reset()
        ...     def compute(self, pred, label):
        ...         return abs(pred[:, 0] - label)          # per example, on device
        ...     def update(self, err):
        ...         self.total += float(err.sum()); self.count += len(err)
        ...     def accumulate(self):
        ...         return self.total / max(self.count, 1)
        ...     def reset(self):
        ...         self.total, self.count = 0.0, 0
        ...     def name(self):
        ...         return ["mae"]
        >>> m = MeanAbsError(); m.update(np.array([1.0, 3.0])); m.accumulate()
        2.0
    """

    def compute(self, outputs: Any, *labels: Any) -> Any:
        """Per-example values for :meth:`update`, computed inside the step (traced).

        Returns an array or a tuple of arrays whose leading axis is the batch.
        """
        return (outputs, *labels)

    @abc.abstractmethod
    def update(self, *args: Any) -> Any:
        """Accumulates one batch of :meth:`compute`'s outputs (host numpy arrays)."""

    @abc.abstractmethod
    def accumulate(self) -> Any:
        """The metric over everything updated since :meth:`reset`."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Clears the accumulated state."""

    @abc.abstractmethod
    def name(self) -> list[str]:
        """The names of the values :meth:`accumulate` returns, as a list."""


class Accuracy(Metric):
    """Top-k classification accuracy (Paddle's ``paddle.metric.Accuracy``).

    Args:
        topk: the ``k`` values to report, e.g. ``(1, 5)``.
        name: the base name; with one ``k`` the metric is called ``name``
            (default ``"acc"``), with several ``"{name}_top{k}"``.

    Labels are class indices of shape ``(N,)`` or ``(N, 1)``, or one-hot /
    soft labels of shape ``(N, num_classes)`` (their argmax is the class).

    Example:
        >>> import numpy as np
        >>> acc = Accuracy(topk=(1, 2))
        >>> pred = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]])
        >>> correct = acc.compute(pred, np.array([2, 0]))
        >>> acc.update(np.asarray(correct))
        [0.5, 1.0]
        >>> acc.name()
        ['acc_top1', 'acc_top2']
    """

    def __init__(self, topk: Sequence[int] | int = (1,), name: str | None = None):
        given = topk
        if isinstance(topk, (int, np.integer)) and not isinstance(topk, bool):
            topk = (int(topk),)
        if (
            not isinstance(topk, (tuple, list))
            or not topk
            or not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1
                       for k in topk)
        ):
            raise FleetConfigError(
                f"Accuracy(topk={given!r}): topk must be a positive int or a non-empty "
                "tuple of positive ints, e.g. topk=(1, 5)"
            )
        if name is not None and not isinstance(name, str):
            raise FleetTypeError(f"Accuracy(name={name!r}): name must be a string")
        self.topk = tuple(int(k) for k in topk)
        self.maxk = max(self.topk)
        base = name or "acc"
        self._names = [base] if len(self.topk) == 1 else [f"{base}_top{k}" for k in self.topk]
        self.reset()

    def compute(self, pred: Any, label: Any, *args: Any) -> jax.Array:
        """``(N, maxk)`` float32: whether the ``i``-th best class is the label."""
        pred = jnp.asarray(pred)
        label = jnp.asarray(label)
        if pred.ndim != 2:
            raise FleetConfigError(
                f"Accuracy expects predictions of shape (batch, num_classes), got "
                f"{pred.shape}; flatten extra axes in the network's output"
            )
        if pred.shape[-1] < self.maxk:
            raise FleetConfigError(
                f"Accuracy(topk={self.topk}) needs at least {self.maxk} classes, but the "
                f"predictions have {pred.shape[-1]}; use a smaller topk"
            )
        if label.ndim == 2 and label.shape[-1] != 1:
            label = jnp.argmax(label, axis=-1)
        label = label.reshape(-1, 1)
        _, top = jax.lax.top_k(pred, self.maxk)
        return (top == label).astype(jnp.float32)

    def update(self, correct: Any, *args: Any) -> list[float] | float:
        """Adds a batch of :meth:`compute` rows; returns the batch's accuracies."""
        correct = np.asarray(correct)
        accs = []
        for i, k in enumerate(self.topk):
            hits = int(correct[:, :k].sum())
            self.total[i] += hits
            self.count[i] += len(correct)
            accs.append(hits / len(correct) if len(correct) else 0.0)
        return accs[0] if len(self.topk) == 1 else accs

    def accumulate(self) -> list[float] | float:
        accs = [t / c if c else 0.0 for t, c in zip(self.total, self.count)]
        return accs[0] if len(self.topk) == 1 else accs

    def reset(self) -> None:
        self.total = [0] * len(self.topk)
        self.count = [0] * len(self.topk)

    def name(self) -> list[str]:
        return list(self._names)


def accuracy(input: Any, label: Any, k: int = 1, correct: Any = None, total: Any = None,
             name: str | None = None) -> jax.Array:
    """Top-``k`` accuracy of one batch (Paddle's ``paddle.metric.accuracy``).

    The fraction of rows whose label is among the ``k`` highest scores of
    ``input``, as a float32 scalar. It works on the host and inside a step; in a
    ``fleet.distributed_step`` each replica computes it on its rows and the step
    returns the mean over replicas, which is the global batch's accuracy when
    every replica has the same number of rows (``drop_last=True``, or no padding).
    For exact accuracy over a whole data set, use :class:`Accuracy`.

    Args:
        input: scores (logits or probabilities) of shape ``(N, num_classes)``.
        label: class indices of shape ``(N,)`` or ``(N, 1)`` (Paddle's layout).
        k: how many of the best classes count as a hit.
        correct, total: Paddle's output tensors; not supported (JAX arrays are
            immutable): use :class:`Accuracy` to accumulate counts.
        name: ignored (Paddle's op name).

    Example:
        >>> import numpy as np
        >>> pred = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]])
        >>> float(accuracy(pred, np.array([[1], [2]]))), float(accuracy(pred, [1, 2], k=2))
        (0.5, 1.0)
    """
    del name
    if correct is not None or total is not None:
        raise FleetUnsupportedError(
            "accuracy(correct=..., total=...): Paddle fills those tensors in place, which JAX "
            "arrays cannot do; use fleet.metric.Accuracy() to accumulate counts over batches"
        )
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise FleetConfigError(f"accuracy(k={k!r}): k must be a positive int")
    input, label = jnp.asarray(input), jnp.asarray(label)
    if input.ndim != 2:
        raise FleetConfigError(
            f"accuracy expects input of shape (batch, num_classes), got {input.shape}; "
            "flatten extra axes in the network's output"
        )
    if input.shape[1] < k:
        raise FleetConfigError(
            f"accuracy(k={k}) needs at least {k} classes, but input has {input.shape[1]}; "
            "use a smaller k"
        )
    if label.shape not in ((input.shape[0],), (input.shape[0], 1)):
        raise FleetConfigError(
            f"accuracy expects label of shape ({input.shape[0]},) or ({input.shape[0]}, 1) "
            f"(class indices for the {input.shape[0]} rows of input), got {label.shape}"
        )
    if not jnp.issubdtype(label.dtype, jnp.integer):
        raise FleetTypeError(
            f"accuracy expects integer class indices as label, got dtype {label.dtype}; "
            "for one-hot labels pass label.argmax(-1)"
        )
    _, top = jax.lax.top_k(input, k)
    hits = jnp.any(top == label.reshape(-1, 1), axis=1)
    return jnp.mean(hits.astype(jnp.float32))
