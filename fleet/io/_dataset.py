"""Map-style datasets: :class:`Dataset` and the array-backed :class:`TensorDataset`.

A dataset is anything with ``__len__`` and ``__getitem__(i)`` that returns sample
``i``: an array, a number, or a tuple / list / dict of them (Paddle's
``paddle.io.Dataset``). The loader calls ``__getitem__`` once per sample and stacks
the samples into a batch.

A dataset that can gather a whole batch at once may also define
``get_batch(indices)``, returning the batch (already stacked). The loader then
takes that vectorised fast path, one gather per batch and no per-sample Python
loop, unless a ``collate_fn`` is given. :class:`TensorDataset` does this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fleet._errors import FleetConfigError, FleetTypeError


class Dataset:
    """Base class of map-style datasets: define ``__getitem__`` and ``__len__``.

    Example:
        >>> import numpy as np
        >>> class Squares(Dataset):
        ...     def __len__(self):
        ...         return 10
        ...     def __getitem__(self, i):
        ...         return np.float32(i * i), np.int32(i)
        >>> Squares()[3]
        (np.float32(9.0), np.int32(3))
    """

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define __getitem__(index) returning sample index"
        )

    def __len__(self) -> int:
        raise NotImplementedError(
            f"{type(self).__name__} must define __len__() returning the number of samples"
        )


class TensorDataset(Dataset):
    """A dataset over in-memory arrays that share their leading (sample) axis.

    Sample ``i`` is ``tuple(a[i] for a in tensors)``, or ``{k: a[i]}`` when
    ``tensors`` is a dict. Arrays are kept as host numpy arrays (a ``jax.Array``
    is copied to the host once). ``get_batch(indices)`` gathers a whole batch
    with one fancy index per array, which the :class:`DataLoader` uses.

    Args:
        tensors: a sequence (or a dict) of arrays with the same length along axis 0.

    Example:
        >>> import numpy as np
        >>> ds = TensorDataset([np.zeros((6, 2)), np.arange(6)])
        >>> len(ds), ds[4][1]
        (6, np.int64(4))
        >>> [a.shape for a in ds.get_batch([0, 5, 2])]
        [(3, 2), (3,)]
    """

    def __init__(self, tensors: Sequence[Any] | Mapping[str, Any]):
        if isinstance(tensors, Mapping):
            names, values = list(tensors.keys()), list(tensors.values())
        elif isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
            names, values = None, list(tensors)
        else:
            raise FleetTypeError(
                f"TensorDataset takes a list (or dict) of arrays, got "
                f"{type(tensors).__name__}; wrap a single array as TensorDataset([array])"
            )
        if not values:
            raise FleetConfigError(
                "TensorDataset got no arrays; pass at least one, e.g. "
                "TensorDataset([images, labels])"
            )
        arrays = [np.asarray(v) for v in values]
        if any(a.ndim == 0 for a in arrays):
            raise FleetConfigError(
                f"TensorDataset arrays must have a sample axis, got shapes "
                f"{[a.shape for a in arrays]}; give arrays of shape (num_samples, ...)"
            )
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) > 1:
            raise FleetConfigError(
                f"TensorDataset arrays have different lengths {lengths}; every array "
                "must hold one row per sample"
            )
        self._names = names
        self.tensors = arrays

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[np.ndarray, ...] | dict[str, np.ndarray]:
        return self._pack(a[index] for a in self.tensors)

    def get_batch(self, indices: Sequence[int]) -> tuple[np.ndarray, ...] | dict[str, np.ndarray]:
        """The samples at ``indices`` stacked along a new leading axis, in one gather."""
        indices = np.asarray(indices)
        return self._pack(np.take(a, indices, axis=0) for a in self.tensors)

    def _pack(self, values):
        if self._names is None:
            return tuple(values)
        return dict(zip(self._names, values))
