"""The pure order: which dataset indices make up each batch of an epoch.

Everything here is a function of its arguments (an epoch, a batch number, the
split): no state, no epoch counter, no position. The samplers
(``fleet/io/_sampler.py``) are thin shells around it.

How :class:`~fleet.io.DistributedBatchSampler` splits an epoch (Paddle's algorithm):

1. Pad ``range(n)`` to ``total_size``, the next multiple of ``num_replicas``, by
   repeating indices from its start, cyclically when ``n < num_replicas``:
   ``order = [0, 1, ..., n-1, 0, 1, ...]``.
2. With ``shuffle=True``, shuffle that padded list in place with
   ``numpy.random.RandomState(epoch).shuffle`` -- the same on every replica.
3. Split batch-strided: in every full window of ``batch_size * num_replicas``
   indices, replica ``r`` takes the ``r``-th block of ``batch_size``; the
   remainder (a multiple of ``num_replicas``) is cut into ``num_replicas`` equal
   contiguous pieces, one last, smaller batch per replica. ``drop_last`` drops
   that last partial batch on every replica.

So step ``k``'s batches of all replicas, in replica order, are one contiguous run
of ``order``: the global batch a ``BatchSampler(batch_size * num_replicas)`` over
``order`` would give.

Where this differs from Paddle's code: Paddle pads with ``indices[:total - n]``,
which comes up short when ``n < num_replicas / 2`` (fleet pads cyclically); Paddle
advances ``epoch`` only when shuffling (fleet on every iteration, which changes
nothing without shuffle); Paddle's ``BatchSampler(shuffle=True)`` draws from numpy's
global RNG (fleet's from ``RandomState(epoch)``, so it can resume).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def padded_order(
    dataset_size: int, num_replicas: int, epoch: int, shuffle: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's index order, padded to a multiple of ``num_replicas``.

    Returns:
        ``(order, is_padding)``: ``order[j]`` is the dataset index at position ``j``;
        ``is_padding[j]`` marks the repeated entries added by the padding (their
        position in the list before shuffling is ``>= dataset_size``).

    Example:
        >>> order, pad = padded_order(5, 4, epoch=0, shuffle=False)
        >>> order.tolist(), pad.tolist()
        ([0, 1, 2, 3, 4, 0, 1, 2], [False, False, False, False, False, True, True, True])
    """
    total = -(-dataset_size // num_replicas) * num_replicas
    positions = np.arange(total)
    if shuffle:
        np.random.RandomState(epoch).shuffle(positions)
    return positions % dataset_size, positions >= dataset_size


def plain_order(dataset_size: int, epoch: int, shuffle: bool) -> np.ndarray:
    """``BatchSampler``'s order over a dataset: ``range(n)``, or its
    ``RandomState(epoch)`` permutation.

    Example:
        >>> plain_order(4, epoch=0, shuffle=False).tolist()
        [0, 1, 2, 3]
    """
    if shuffle:
        return np.random.RandomState(epoch).permutation(dataset_size)
    return np.arange(dataset_size)


def fixed_order(sampler: Iterable[int]) -> np.ndarray:
    """``BatchSampler(sampler=...)``'s order: the sampler's indices, as it gives them."""
    return np.asarray(list(sampler), dtype=np.int64)


def batch_slices(
    total_size: int, batch_size: int, num_replicas: int, first: int, count: int, drop_last: bool
) -> list[slice]:
    """Where the batches of replicas ``[first, first + count)`` lie in the padded order.

    Step ``k``'s slice holds those replicas' ``k``-th batches, concatenated in
    replica order (``count`` blocks of ``batch_size``, or of the last partial size).
    ``first=0, count=num_replicas`` gives the global batches.

    Example:
        >>> batch_slices(10, batch_size=2, num_replicas=2, first=1, count=1, drop_last=False)
        [slice(2, 4, None), slice(6, 8, None), slice(9, 10, None)]
    """
    window = batch_size * num_replicas
    full, tail = divmod(total_size, window)
    slices = [
        slice(k * window + first * batch_size, k * window + (first + count) * batch_size)
        for k in range(full)
    ]
    last = tail // num_replicas
    if last and not drop_last:
        start = full * window
        slices.append(slice(start + first * last, start + (first + count) * last))
    return slices


def padding_rows(
    dataset_size: int, batch_size: int, num_replicas: int, epoch: int, shuffle: bool,
    drop_last: bool,
) -> list[np.ndarray]:
    """For every step of ``epoch``, which rows of the *global* batch are padding.

    Example:
        >>> [m.tolist() for m in padding_rows(5, 2, 2, epoch=0, shuffle=False, drop_last=False)]
        [[False, False, False, False], [False, True]]
    """
    is_padding = padded_order(dataset_size, num_replicas, epoch, shuffle)[1]
    slices = batch_slices(len(is_padding), batch_size, num_replicas, 0, num_replicas,
                          drop_last)
    return [is_padding[s] for s in slices]
