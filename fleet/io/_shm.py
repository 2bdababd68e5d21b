"""Shared memory for batches coming back from DataLoader workers.

Pickling a batch through a pipe copies it four times and, for a few MB, costs
many context switches. Instead the main process hands each task a shared-memory
block; the worker copies the batch's numeric arrays into it and sends back only
the batch's structure (a "skeleton" with placeholders); the main process copies
the block into one private buffer and frees the block for the next task. The
main process creates and unlinks every block, so a killed worker leaks nothing.

Blocks are sized from the first batches, which travel by pickle and report the
size they need; a later, larger batch does the same and the blocks grow.
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any, NamedTuple

import numpy as np

_ALIGN = 64


class _Leaf(NamedTuple):
    """Where one array of the batch lies in the block (a NamedTuple: ``_walk`` walks
    only plain tuples)."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


def _is_packable(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind in "biufc"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _walk(x: Any, fn):
    """Applies ``fn`` to the arrays inside plain tuples / lists / dicts."""
    if type(x) is tuple:
        return tuple(_walk(v, fn) for v in x)
    if type(x) is list:
        return [_walk(v, fn) for v in x]
    if type(x) is dict:
        return {k: _walk(v, fn) for k, v in x.items()}
    return fn(x)


def packed_size(batch: Any) -> int:
    """Bytes a block needs to hold ``batch``'s arrays."""
    total = 0

    def count(x):
        nonlocal total
        if _is_packable(x):
            total += _aligned(x.nbytes)
        return x

    _walk(batch, count)
    return total


def write(batch: Any, block: memoryview) -> Any | None:
    """Copies ``batch``'s arrays into ``block``; the skeleton, or None if it is too small."""
    if packed_size(batch) > len(block):
        return None
    offset = 0

    def put(x):
        nonlocal offset
        if not _is_packable(x):
            return x
        leaf = _Leaf(offset, x.shape, x.dtype)
        np.copyto(np.ndarray(x.shape, x.dtype, buffer=block, offset=offset), x)
        offset += _aligned(x.nbytes)
        return leaf

    return _walk(batch, put)


def read(skeleton: Any, block: memoryview, used: int) -> Any:
    """The batch, copied out of ``block`` into one private buffer."""
    own = np.frombuffer(block, np.uint8, count=used).copy()

    def get(x):
        if isinstance(x, _Leaf):
            return np.ndarray(x.shape, x.dtype, buffer=own, offset=x.offset)
        return x

    return _walk(skeleton, get)


class BlockPool:
    """Up to ``count`` shared-memory blocks, each lent to one task at a time."""

    def __init__(self, count: int):
        self._count = count
        self._size = 0
        self._free: list[shared_memory.SharedMemory] = []
        self._all: list[shared_memory.SharedMemory] = []

    def need(self, size: int) -> None:
        """A batch needed ``size`` bytes: new blocks are made at least that large."""
        self._size = max(self._size, size)

    def acquire(self) -> shared_memory.SharedMemory | None:
        while self._free:
            block = self._free.pop()
            if block.size >= self._size:
                return block
            self._destroy(block)
        if self._size and len(self._all) < self._count:
            block = shared_memory.SharedMemory(create=True, size=self._size)
            self._all.append(block)
            return block
        return None

    def release(self, block: shared_memory.SharedMemory) -> None:
        self._free.append(block)

    def close(self) -> None:
        for block in list(self._all):
            self._destroy(block)
        self._free = []

    def _destroy(self, block: shared_memory.SharedMemory) -> None:
        self._all.remove(block)
        block.close()
        block.unlink()
