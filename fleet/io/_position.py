"""Where iteration stands, held once: by the iterator that hands the batches out.

A position is an epoch and the number of its batches handed out. While an
iteration runs, its position lives in one object only, its iterator (the
sampler's own, or the ``DataLoader``'s), which counts a batch when it hands it
out (never when it is loaded ahead). Nobody else holds or advances it:

* a sampler or a loader that wants to know where its iteration stands (for
  ``state_dict()``, ``gather_for_metrics``) keeps a :class:`Tracker`, which
  reads the running iterator through a weak reference and, once the iterator
  stops (its epoch's end, ``break``, an error, a dropped iterator), keeps the
  :class:`Progress` it left: an immutable value;
* ``set_state_dict()`` gives the next iteration its start as an immutable
  :class:`Position`, and the iteration takes it over when it starts.

So the samplers are pure orders (epoch, batch number -> indices) plus an epoch
counter, and ``state_dict()`` is computed, never a shared mutable object.

Example:
    >>> tracker = Tracker()
    >>> it = Iteration(Position(epoch=3, done=1), length=5)
    >>> tracker.follow(it)
    >>> it.done += 1  # the iterator handed a batch out
    >>> tracker.last()
    Progress(epoch=3, first=1, done=2, finished=False)
    >>> del it  # dropped: it leaves where it stopped
    >>> tracker.last()
    Progress(epoch=3, first=1, done=2, finished=False)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple


class Position(NamedTuple):
    """An epoch and the number of its batches already handed out (a value)."""

    epoch: int
    done: int


class Progress(NamedTuple):
    """Where one iteration stands: its epoch, the batch it began at (a restored
    position begins past 0), the batches of the epoch handed out so far, and
    whether it ran to the epoch's end."""

    epoch: int
    first: int
    done: int
    finished: bool


class Iteration:
    """Base of the iterators that hand batches out: the one home of a running position.

    Only the iterator itself advances ``done`` (when a batch reaches the user) and
    calls :meth:`_stop`; when it stops, or is dropped, it tells the trackers that
    follow it where it stopped.
    """

    def __init__(self, start: Position, length: int):
        self.epoch, self.first, self.done = start.epoch, start.done, start.done
        self.length = length  # batches in the epoch
        self.finished = False
        self._followers: list[Callable[[Progress], None]] = []

    @property
    def progress(self) -> Progress:
        return Progress(self.epoch, self.first, self.done, self.finished)

    def _stop(self, finished: bool = False) -> None:
        """The iteration ends (``finished``: at its epoch's end); its followers are
        told where, once."""
        self.finished = self.finished or finished
        followers, self._followers = self._followers, []
        for tell in followers:
            tell(self.progress)

    def __del__(self):
        try:
            self._stop()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing to tell)
            pass


class Tracker:
    """What an owner (a sampler, a loader) knows of its last iteration, holding no position.

    While the iteration runs, :meth:`last` reads it through a weak reference; once
    it stops, :meth:`last` is the :class:`Progress` it left. An owner replaces its
    tracker when a new iteration starts or a state is restored, so an older
    iteration that stops later tells a tracker nobody reads.
    """

    def __init__(self):
        self._running: weakref.ref | None = None
        self._left: Progress | None = None

    def follow(self, iteration: Iteration) -> None:
        """``iteration`` is now the one this tracker reports."""
        ref = weakref.ref(iteration)
        self._running, self._left = ref, None

        def left(progress: Progress) -> None:
            if self._running is ref:
                self._left = progress

        iteration._followers.append(left)

    def last(self) -> Progress | None:
        """The followed iteration's progress (running or stopped); ``None`` if none."""
        running = self._running() if self._running is not None else None
        return running.progress if running is not None else self._left

    def __getstate__(self) -> dict:  # a pickled sampler keeps what it reads, not the iterator
        return {"_running": None, "_left": self.last()}


def resume_point(restored: Position | None, epoch: int) -> Position:
    """Where an iteration of ``epoch`` starts: a restored position of that epoch
    continues; anything else starts the epoch from its first batch.

    Example:
        >>> resume_point(Position(2, 5), 2), resume_point(Position(2, 5), 3)
        (Position(epoch=2, done=5), Position(epoch=3, done=0))
    """
    if restored is not None and restored.epoch == epoch:
        return restored
    return Position(epoch, 0)
