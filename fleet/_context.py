"""What the per-device step is doing while it is being traced.

``fleet.distributed_step`` opens a :class:`StepTrace` around the user's function;
the gradient reduction reads it to know that it runs inside the step (so a
``psum`` over the ``data`` axis is legal), whether ``no_sync`` is on, and where
the locally accumulated gradients of earlier ``no_sync`` steps are.

``no_sync`` itself is a plain flag of the calling thread: it is read when the
step is called, and the step compiles separately with and without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from fleet._errors import FleetError


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """How gradients are grouped for the all-reduce (sizes in MB of 2**20 bytes)."""

    comm_buffer_size: float = 25.0
    last_comm_buffer_size: float = 1.0
    fuse: bool = True


@dataclasses.dataclass
class StepTrace:
    """State of one trace of the per-device step body."""

    num_replicas: int
    buckets: BucketConfig
    no_sync: bool = False
    accum: list | None = None  # this device's accumulated gradient leaves (no_sync)
    accum_count: Any = None  # traced scalar: how many steps are in ``accum``
    new_accum: list | None = None  # what the step leaves accumulated for the next one
    accum_consumed: bool = False
    reduced: list = dataclasses.field(default_factory=list)  # leaves already averaged

    def mark_reduced(self, leaves: list) -> None:
        self.reduced.extend(leaves)

    def is_reduced(self, leaves: list) -> bool:
        ids = {id(x) for x in self.reduced}
        return bool(leaves) and all(id(x) in ids for x in leaves)


_local = threading.local()


def current() -> StepTrace | None:
    """The trace in progress, or ``None`` outside a distributed step."""
    stack = getattr(_local, "traces", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def tracing(trace: StepTrace) -> Iterator[StepTrace]:
    stack = _local.__dict__.setdefault("traces", [])
    stack.append(trace)
    try:
        yield trace
    finally:
        stack.pop()


def no_sync_active() -> bool:
    return getattr(_local, "no_sync", 0) > 0


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    if current() is not None:
        raise FleetError(
            "no_sync() was entered inside a distributed step; enter it around the call "
            "instead: `with model.no_sync(): loss = train_step(model, optimizer, x, y)`"
        )
    _local.no_sync = getattr(_local, "no_sync", 0) + 1
    try:
        yield
    finally:
        _local.no_sync -= 1
