"""Two small settings objects of the core: the bucket plan and ``no_sync``.

``BucketConfig`` is how gradients are grouped for the all-reduce; a wrapped
model carries one (``fleet.DataParallel(comm_buffer_size=...)``), and the
strategy's ``fuse_grad_size_in_MB`` / ``last_comm_group_size_MB`` give the
defaults (:data:`DEFAULT_BUCKET_MB`, :data:`DEFAULT_LAST_BUCKET_MB`).

``no_sync`` is a ``with`` block around step calls, as in Paddle and torch DDP:
a flag of the calling thread, read when the step is called (the step compiles
separately with and without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from fleet._errors import FleetError

#: The one default bucket size (MB of 2**20 bytes), and the cap of the first bucket.
DEFAULT_BUCKET_MB = 32.0
DEFAULT_LAST_BUCKET_MB = 1.0


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """How gradients are grouped for the all-reduce (sizes in MB of 2**20 bytes)."""

    comm_buffer_size: float = DEFAULT_BUCKET_MB
    last_comm_buffer_size: float = DEFAULT_LAST_BUCKET_MB
    fuse: bool = True
    #: ``strategy.fp16_allreduce``: the 16-bit dtype name the buckets travel in
    #: (divided by the replica count first), or None for the gradients' own dtype.
    wire_dtype: str | None = None


_local = threading.local()


def no_sync_active() -> bool:
    return getattr(_local, "no_sync", 0) > 0


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    from fleet import _sync

    if _sync.current() is not None:
        raise FleetError(
            "no_sync() was entered inside a distributed step; enter it around the call "
            "instead: `with model.no_sync(): loss = train_step(model, optimizer, x, y)`"
        )
    _local.no_sync = getattr(_local, "no_sync", 0) + 1
    try:
        yield
    finally:
        _local.no_sync -= 1
