"""Reads that end together: when one array of a step cannot be read, nothing else
is left running in orbax's event loop.

The fault: orbax (0.12.8) reads a step in a fresh asyncio event loop
(``run_until_complete``, then ``close``), its arrays all at once
(``asyncio.gather``). When one read fails, ``gather`` raises at once, the loop
is closed, and the other reads are still in flight in tensorstore's threads;
as each ends, tensorstore calls ``loop.call_soon_threadsafe`` on the closed
loop and prints the ``RuntimeError: Event loop is closed`` that raises. A
damaged step printed a few of those tracebacks beside fleet's own error.

The fix, through orbax's public type-handler interface: fleet's handlers
subclass orbax's (:class:`ArrayHandler`, :class:`NumpyHandler`,
:class:`ScalarHandler`, :class:`StringHandler`) and wrap the two methods that
read (``metadata`` and ``deserialize``):

* a read that fails waits for every task started since the call began (the
  other reads of its batch, still in flight) to end while the loop still runs,
  so that tensorstore's callbacks all reach an open loop. Those still running
  after :data:`STOP_WAIT_S` seconds are cancelled (a cancelled tensorstore read
  takes back its callback, unless it is just then being made);
* inside :func:`collect`, which every fleet call that reads a step runs in,
  the error does not go on into orbax at all: it is recorded, the call
  returns ``None`` for its values, and orbax's other handlers finish their
  reads too (a read cancelled after another one failed is recorded after
  that failure). The caller raises the first
  record (a damaged step, :class:`fleet.checkpoint._errors.Damaged`), after
  orbax's loop has ended with nothing in flight.

Saving is not wrapped: orbax's commit waits for every write.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

# The failures recorded inside collect() (None outside it). Orbax's tasks copy
# the caller's context when they are made, so they all see the caller's list.
_FAILURES: contextvars.ContextVar[list[Exception] | None] = contextvars.ContextVar(
    "fleet_checkpoint_read_failures", default=None)


@contextlib.contextmanager
def collect() -> Iterator[list[Exception]]:
    """Records the reads that fail inside the block (in the list it yields, the
    first failure first) instead of raising them into orbax; values read by a
    failed call are ``None``.

    Example:
        >>> with collect() as failed:  # doctest: +SKIP
        ...     values = checkpointer.restore(path, args=args)
        >>> if failed:
        ...     raise Damaged(...)
    """
    failures: list[Exception] = []
    token = _FAILURES.set(failures)
    try:
        yield failures
    finally:
        _FAILURES.reset(token)


#: How long a failed read waits for the reads still in flight to end before it
#: cancels them (they end within milliseconds: they fail alike, or finish; the
#: bound keeps one that waits for the failed read's bytes, orbax's limit on the
#: bytes in flight, from hanging the restore).
STOP_WAIT_S = 10.0


async def _stop(tasks: set[asyncio.Task]) -> None:
    """Waits (at most :data:`STOP_WAIT_S`) for ``tasks`` to end, then cancels the
    rest and waits for them."""
    if not tasks:
        return
    _, running = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=STOP_WAIT_S)
    for task in tasks:  # (their errors follow from the first: seen, not reported)
        if task.done() and not task.cancelled():
            task.exception()


async def _settled(read: Awaitable[Sequence[Any]], count: int) -> Sequence[Any]:
    """``await read`` (the ``count`` values of one handler call); if it fails, first
    lets every task started since (the reads still in flight) end."""
    me = asyncio.current_task()
    before = asyncio.all_tasks()
    try:
        return await read
    except (Exception, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError) and me is not None and me.cancelling():
            raise  # (this call itself is cancelled, not one of its reads)
        failures = _FAILURES.get()
        if failures is not None:  # (first: before the reads it waits for record theirs)
            failures.append(e if isinstance(e, Exception) else
                            RuntimeError("a read cancelled after another one failed"))
        await _stop(asyncio.all_tasks() - before - {me})
        if failures is None:
            raise
        return [None] * count


class _Settled:
    """The reading methods of an orbax type handler, settled (:func:`_settled`)."""

    async def metadata(self, infos: Sequence[ocp.type_handlers.ParamInfo]) -> Sequence[Any]:
        """orbax's ``metadata``; ``None`` for each value if it fails inside :func:`collect`."""
        return await _settled(super().metadata(infos), len(infos))

    async def deserialize(self, infos: Sequence[ocp.type_handlers.ParamInfo],
                          args: Sequence[ocp.RestoreArgs] | None = None) -> Sequence[Any]:
        """orbax's ``deserialize``; ``None`` for each value if it fails inside :func:`collect`."""
        return await _settled(super().deserialize(infos, args), len(infos))


class ArrayHandler(_Settled, ocp.type_handlers.ArrayHandler):
    """orbax's handler of ``jax.Array`` s, its reads settled."""


class NumpyHandler(_Settled, ocp.type_handlers.NumpyHandler):
    """orbax's handler of numpy arrays, its reads settled."""


class ScalarHandler(_Settled, ocp.type_handlers.ScalarHandler):
    """orbax's handler of Python and numpy numbers, its reads settled."""


class StringHandler(_Settled, ocp.type_handlers.StringHandler):
    """orbax's handler of strings, its reads settled."""


def read_types() -> ocp.type_handlers.TypeHandlerRegistry:
    """The types of a PyTree directory any fleet wrote (the arrays of a manager's
    step, and numbers and strings of the earlier ``fleet.save``), read settled."""
    scalar = ScalarHandler()
    return ocp.type_handlers.create_type_handler_registry(
        (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar),
        (np.ndarray, NumpyHandler()), (jax.Array, ArrayHandler()), (str, StringHandler()),
    )
