"""Stopping workers: one protocol for ``fleetrun`` and ``fleet.spawn``.

Each worker runs in a session (and process group) of its own and gets ``SIGKILL``
from the kernel if its launcher dies, even by ``SIGKILL`` (:func:`die_with_parent`).
Stopping a group is ``SIGTERM`` (and ``SIGCONT``, for stopped workers) to every
worker's process group and to the worker itself (a ``fleet.spawn`` child may not
have made its group yet), then ``SIGKILL`` to every group after a short grace, or
at once when the caller says to hurry (a second Ctrl-C): JAX workers take
``SIGTERM`` as a preemption notice and keep running, so the ``SIGKILL`` is what
ends them. Leftover children of a worker die with its group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

TERMINATE_GRACE = 3.0  # seconds between SIGTERM and SIGKILL
_PR_SET_PDEATHSIG = 1


class Stoppable(Protocol):
    """A worker as the stop protocol sees it (``_supervisor.Worker``: a ``Popen`` or a
    ``multiprocessing`` process behind a small adapter)."""

    @property
    def pid(self) -> int | None: ...

    def has_exited(self) -> bool: ...

    def wait_exit(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s; whether the worker has exited (and was reaped)."""
        ...


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int) -> None:
    """In a child: ask the kernel for ``SIGKILL`` when the parent dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before we asked
        os._exit(1)


def signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _signal(worker: Stoppable, signum: int) -> None:
    signal_group(worker.pid, signum)
    if not worker.has_exited():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(worker.pid, signum)


def stop(workers: Sequence[Stoppable], grace: float = TERMINATE_GRACE,
         hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM (+SIGCONT) to every live worker, SIGKILL to all after ``grace`` s (or
    as soon as ``hurry()``), then waits for every worker."""
    alive = [w for w in workers if w.pid is not None and not w.has_exited()]
    for w in alive:
        _signal(w, signal.SIGTERM)
        _signal(w, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for w in alive:
        while not w.wait_exit(0.05) and time.monotonic() < deadline:
            if hurry():
                deadline = 0.0
    kill(workers)


def kill(workers: Sequence[Stoppable], wait: float = 10.0) -> None:
    """SIGKILL to every worker's group (leftover children too), then waits for each."""
    for w in workers:
        if w.pid is not None:
            _signal(w, signal.SIGKILL)
    for w in workers:
        if w.pid is not None:
            w.wait_exit(wait)
