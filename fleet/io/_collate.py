"""Turning a list of indices into a batch: fetch the samples, stack them.

:func:`fetch_batch` is what both the main process (``num_workers=0``) and the
worker processes run for one batch; :func:`default_collate_fn` stacks samples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fleet.io._errors import FleetDataError

_SHAPES_HINT = (
    "every sample of a batch must have the same shape: resize, crop or pad in the "
    "dataset's __getitem__, or pass a collate_fn that does"
)


def fetch_batch(
    dataset: Any, indices: Sequence[int], collate_fn: Callable[[list], Any] | None
) -> Any:
    """Loads the samples at ``indices`` and collates them into one batch.

    A dataset with ``get_batch(indices)`` (e.g. :class:`TensorDataset`) is asked for
    the whole batch at once, unless a ``collate_fn`` is given.
    """
    if collate_fn is None and hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    indices = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)
    samples = [_sample(dataset, i) for i in indices]  # Python ints, as Paddle passes them
    if collate_fn is not None:
        return collate_fn(samples)
    return _collate(samples, indices, "")


def _sample(dataset: Any, i: int) -> Any:
    """``dataset[i]``; an ``IndexError`` for an index below ``len(dataset)`` says so."""
    try:
        return dataset[i]
    except IndexError as e:
        try:
            size = len(dataset)
        except TypeError:
            raise e from None
        raise FleetDataError(
            f"{type(dataset).__name__}[{i}] raised IndexError ({e}), although "
            f"len({type(dataset).__name__}) is {size} and the sampler asked for index {i} "
            f"of range(0, {size}); make __len__ say how many samples __getitem__ serves"
        ) from e


def default_collate_fn(samples: list[Any]) -> Any:
    """Stacks a list of samples into a batch of numpy arrays (Paddle's default).

    Samples are arrays, numbers, or (nested) tuples / lists / dicts of them; the
    batch has the same structure with a new leading axis (lists become tuples).
    Strings are gathered into a list. Samples of different shapes raise
    :class:`fleet.io.FleetDataError` naming the sample.

    Example:
        >>> import numpy as np
        >>> x, y = default_collate_fn([(np.zeros(3), 1), (np.ones(3), 0)])
        >>> x.shape, y.tolist()
        ((2, 3), [1, 0])
    """
    return _collate(samples, list(range(len(samples))), "")


def _collate(samples: list[Any], indices: list[int], path: str) -> Any:
    for j, sample in enumerate(samples):
        if sample is None:
            raise FleetDataError(_not_data(None, indices[j], path))
    first = samples[0]
    if isinstance(first, Mapping):
        _same_structure(samples, indices, path, Mapping, lambda s: f"keys {list(s.keys())}")
        return {k: _collate([s[k] for s in samples], indices, f"{path}[{k!r}]") for k in first}
    if isinstance(first, (tuple, list)):
        _same_structure(samples, indices, path, (tuple, list), lambda s: f"{len(s)} fields")
        return tuple(
            _collate([s[i] for s in samples], indices, f"{path}[{i}]") for i in range(len(first))
        )
    if isinstance(first, (str, bytes)):
        return list(samples)
    arrays = [np.asarray(s) for s in samples]
    for j, a in enumerate(arrays):
        if a.dtype == object:
            raise FleetDataError(_not_data(samples[j], indices[j], path))
    shape = arrays[0].shape
    for j, a in enumerate(arrays):
        if a.shape != shape:
            raise FleetDataError(
                f"sample at dataset index {indices[j]} (position {j} of its batch) has"
                f"{_at(path)} shape {a.shape}, but dataset index {indices[0]} has shape "
                f"{shape}; {_SHAPES_HINT}"
            )
    return np.stack(arrays)


def _same_structure(samples: list[Any], indices: list[int], path: str, kind: Any,
                    describe: Callable[[Any], str]) -> None:
    """Raises unless every sample is a ``kind`` that ``describe`` (its keys, its number
    of fields) tells apart from the first sample in no way."""
    want = describe(samples[0])
    for j, sample in enumerate(samples):
        got = describe(sample) if isinstance(sample, kind) else f"type {type(sample).__name__}"
        if got != want:
            raise FleetDataError(
                f"sample at dataset index {indices[j]} has{_at(path)} {got}, but dataset "
                f"index {indices[0]} has {want}; every sample must have the same structure"
            )


def _not_data(value: Any, index: int, path: str) -> str:
    if value is None:
        what, advice = "None", ("make __getitem__ return the sample on every path (a missing "
                                "`return` gives None)")
    else:
        what = f"a {type(value).__name__} object ({_short(value)})"
        advice = ("numpy cannot batch it: convert it to an array or a number in __getitem__, "
                  "or pass a collate_fn that batches such objects")
    return (f"sample at dataset index {index}{_at(path)} is {what}; {advice}. A sample is an "
            "array, a number, a string, or a tuple / list / dict of them")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _at(path: str) -> str:
    return f" at {path}" if path else ""
