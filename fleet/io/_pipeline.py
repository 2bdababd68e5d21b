"""The loader's pipeline: a source of host batches, a producer, the user's iterator.

The source yields host (numpy) batches: :func:`in_process` fetches them in this
process, :func:`from_workers` from worker processes, keeping ``depth`` batches in
flight. A producer runs the source: :class:`ThreadProducer` in a daemon thread up
to ``prefetch_factor`` batches ahead (Paddle's ``use_buffer_reader``),
:class:`InlineProducer` in the caller's thread when asked. :class:`LoaderIterator`
places batches on the devices and hands them out; it holds the iteration's position
(``fleet/io/_position.py``), counting a batch when it hands it out, never when it is
loaded ahead.

Overlap. Per-sample loading runs in a background thread (``use_buffer_reader``) or
in worker processes, up to ``prefetch_factor`` host batches ahead, and the main
thread places batches on the devices one ahead: when batch ``k`` is handed out,
batch ``k + 1`` (if loaded) has been placed too, so its transfer overlaps step
``k`` (the ``flax.jax_utils.prefetch_to_device`` pattern). Transfers stay on the
main thread: measured on CPU devices, transferring from a second thread was
markedly slower.

The vectorised fast path (a ``get_batch`` dataset, no workers) loads in the main
thread by default: one gather and one transfer, issued when the loop asks for the
next batch -- which, with JAX's asynchronous dispatch, is while the previous step
still runs on the devices. A thread added no speed there and cost CPU time on a
busy host (``benchmarks/loader_throughput.py`` has both); pass
``use_buffer_reader=True`` for a training loop that waits for every step to finish.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from fleet.io._collate import fetch_batch
from fleet.io._position import Iteration, Position
from fleet.io._workers import WorkerPool

_THREAD_JOIN_TIMEOUT_S = 30.0


class LoaderIterator(Iteration):
    """What ``iter(loader)`` returns; stops its thread and workers when closed or dropped.

    It holds the iteration's position (``epoch``, ``done``: batches handed out), which
    the loader's and the sampler's ``state_dict()`` read. ``_ready`` holds, in order,
    what the producer delivered and the main thread already placed on the devices:
    ``("batch", arrays)``, ``("end", None)`` or ``("error", exception)`` -- an error is
    raised only after the batches before it.
    """

    def __init__(self, producer, transfer, lookahead, pool, owns_pool, start: Position,
                 length: int):
        super().__init__(start, length)
        self._producer, self._transfer = producer, transfer
        self._lookahead = lookahead  # batches placed on the devices beyond the one handed out
        self._pool, self._owns_pool = pool, owns_pool
        self._ready: deque[tuple[str, Any]] = deque()
        self._closed = False

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self.length - self.first  # the batches this iteration yields

    def __next__(self):
        if self._closed:
            raise StopIteration
        try:
            if not self._ready:
                self._ready.append(self._receive(block=True))
            kind, payload = self._ready.popleft()
            if kind == "batch":
                while len(self._ready) < self._lookahead and self._top_up():
                    pass
        except BaseException:  # KeyboardInterrupt while waiting.
            self.close()
            raise
        if kind == "batch":
            self.done += 1  # counted when handed out, not when loaded ahead
            return payload
        if kind == "end":
            self._stop(finished=True)
            self.close()
            raise StopIteration
        self.close()
        raise payload

    def _top_up(self) -> bool:
        """Places one more already-loaded batch on the devices; False if none is there."""
        if self._ready and self._ready[-1][0] != "batch":
            return False
        item = self._receive(block=False)
        if item is None:
            return False
        self._ready.append(item)
        return True

    def _receive(self, block: bool) -> tuple[str, Any] | None:
        item = self._producer.get(block)
        if item is None or item[0] != "batch" or self._transfer is None:
            return item
        try:
            return "batch", self._transfer(item[1])
        except Exception as e:
            return "error", e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop()  # tells the trackers where it stopped
        self._ready.clear()
        self._producer.request_stop()
        pool_in_use = self._pool is not None and not self.finished
        if self._pool is not None and (self._owns_pool or pool_in_use):
            self._pool.close()  # Its workers die, so the thread's pending recv ends.
        self._producer.join()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ThreadProducer:
    """A daemon thread that runs ``source`` (host batches) into a bounded queue.

    The thread holds no reference to the iterator, so dropping the iterator
    closes it. Stopping: set the flag, then drain the queue; the thread checks the
    flag around every ``put``, so it puts at most one more item and exits.
    """

    def __init__(self, source: Iterator[Any], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source,), name="fleet-io-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, source):
        try:
            for batch in source:
                if self._stop.is_set():
                    return
                self._queue.put(("batch", batch))
                if self._stop.is_set():
                    return
            self._queue.put(("end", None))
        except BaseException as e:
            if not self._stop.is_set():
                self._queue.put(("error", e))

    def get(self, block: bool = True) -> tuple[str, Any] | None:
        """The next item; ``None`` if ``block`` is false and none is ready."""
        try:
            return self._queue.get(block)
        except queue.Empty:
            return None

    def request_stop(self) -> None:
        self._stop.set()
        self._drain()

    def join(self) -> None:
        self._drain()
        self._thread.join(_THREAD_JOIN_TIMEOUT_S)
        self._drain()

    def _drain(self) -> None:
        while self.get(block=False) is not None:
            pass


class InlineProducer:
    """Runs ``source`` in the calling thread, when asked (``use_buffer_reader=False``)."""

    def __init__(self, source: Iterator[Any]):
        self._source = source

    def get(self, block: bool = True) -> tuple[str, Any] | None:
        try:
            return "batch", next(self._source)
        except StopIteration:
            return "end", None
        except Exception as e:
            return "error", e

    def request_stop(self) -> None:
        self._source.close()

    def join(self) -> None:
        pass


def in_process(dataset, indices, collate_fn):
    for batch_indices in indices:
        yield fetch_batch(dataset, batch_indices, collate_fn)


def from_workers(pool: WorkerPool, indices: Iterator[list[int]], depth: int):
    """Keeps ``depth`` batches in flight on the workers; yields them in order."""
    pending: deque[int] = deque()
    seq = 0
    for batch_indices in itertools.chain(indices, [None]):
        if batch_indices is not None:
            pool.submit(seq, batch_indices)
            pending.append(seq)
            seq += 1
            if len(pending) < depth:
                continue
        while pending and (batch_indices is None or len(pending) >= depth):
            yield pool.result(pending.popleft())
