"""Worker processes that load batches for the :class:`DataLoader`.

Workers are started with ``spawn`` (never ``fork``: the main process runs JAX's
threads), so the dataset, ``collate_fn`` and ``worker_init_fn`` must be picklable and
the training script needs the usual ``if __name__ == "__main__":`` guard
(``fleet/io/_main_guard.py`` names the line when it is missing).

Each worker has its own duplex pipe. Batch ``seq`` goes to worker
``seq % num_workers`` and every worker answers in the order it was asked, so reading
batch ``seq`` from worker ``seq % num_workers`` keeps batches in order with no
reordering buffer. The arrays of a batch come back through shared memory
(``fleet/io/_shm.py``), the rest of it through the pipe.

Workers ignore SIGINT (Ctrl-C reaches the whole process group; the main process
decides what happens) and exit when their pipe closes, so they never outlive the
main process. An exception in a worker travels back and is
raised in the main process, its ``__cause__`` holding the worker's traceback.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import random
import signal
import traceback
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from fleet._errors import FleetConfigError
from fleet.io import _main_guard, _shm
from fleet.io._collate import fetch_batch
from fleet.io._errors import FleetWorkerError

_JOIN_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What :func:`get_worker_info` tells code running in a worker process."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


_WORKER_INFO: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """This worker's id, count, seed and dataset copy; ``None`` in the main process.

    Example:
        >>> get_worker_info() is None
        True
    """
    return _WORKER_INFO


class _RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of its exception."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class WorkerPool:
    """``num_workers`` spawned processes that turn index lists into batches."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable | None,
        num_workers: int,
        worker_init_fn: Callable[[int], None] | None,
        base_seed: int,
        max_in_flight: int,
    ):
        _main_guard.check(num_workers)
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        self._blocks = _shm.BlockPool(max_in_flight)
        self._in_flight: dict[int, Any] = {}
        try:
            for worker_id in range(num_workers):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_loop,
                    args=(child_end, dataset, collate_fn, worker_id, num_workers,
                          base_seed + worker_id, worker_init_fn),
                    name=f"fleet-io-worker-{worker_id}",
                    daemon=True,
                )
                try:
                    proc.start()
                except (pickle.PicklingError, AttributeError, TypeError) as e:
                    parent_end.close()
                    raise FleetConfigError(
                        f"num_workers={num_workers} starts worker processes with spawn, "
                        f"which must pickle the dataset ({type(dataset).__name__}), "
                        f"collate_fn and worker_init_fn, and could not: {e}. Define them "
                        "at module level (not inside a function), or use num_workers=0"
                    ) from e
                finally:
                    child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise
        self.closed = False

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def submit(self, seq: int, indices: list[int]) -> None:
        """Asks worker ``seq % num_workers`` for the batch at ``indices``."""
        worker = seq % self.num_workers
        block = self._blocks.acquire()
        self._in_flight[seq] = block
        try:
            self._conns[worker].send((seq, indices, None if block is None else block.name))
        except OSError:
            raise self._died(worker, seq) from None

    def result(self, seq: int) -> Any:
        """Batch ``seq``; call in ``seq`` order. Re-raises the worker's exception."""
        worker = seq % self.num_workers
        try:
            kind, got, payload, size = self._conns[worker].recv()
        except (EOFError, OSError):
            raise self._died(worker, seq) from None
        if got != seq:
            raise FleetWorkerError(
                f"DataLoader worker {worker} answered batch {got} when batch {seq} was "
                "due; this is a bug in fleet.io, please report it"
            )
        block = self._in_flight.pop(seq)
        try:
            if kind == "error":
                raise _rebuild_exception(payload, worker, self._procs[worker].pid, seq)
            if kind == "shm":
                return _shm.read(payload, block.buf, size)
            self._blocks.need(size)  # It came by pickle: the next blocks will fit it.
            return payload
        finally:
            if block is not None:
                self._blocks.release(block)

    def close(self) -> None:
        """Stops every worker at once (they hold no state) and waits for them."""
        self.closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._blocks.close()
        self._in_flight.clear()

    def _died(self, worker: int, seq: int) -> FleetWorkerError:
        proc = self._procs[worker]
        proc.join(_JOIN_TIMEOUT_S)
        return FleetWorkerError(
            f"DataLoader worker {worker} (pid {proc.pid}) exited unexpectedly with exit "
            f"code {proc.exitcode} while loading batch {seq}. A negative code is the "
            "signal that killed it (-9: often the out-of-memory killer; -11: a crash in "
            "native code). Run with num_workers=0 to see the failure in the main process"
        )


def _worker_loop(conn, dataset, collate_fn, worker_id, num_workers, seed, worker_init_fn):
    global _WORKER_INFO
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    _WORKER_INFO = WorkerInfo(worker_id, num_workers, seed, dataset)
    init_error = None
    blocks: dict[str, shared_memory.SharedMemory] = {}
    if worker_init_fn is not None:
        try:
            worker_init_fn(worker_id)
        except Exception as e:  # Reported with the first batch this worker is asked for.
            init_error = _pack_exception(e)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        seq, indices, block_name = task
        if init_error is not None:
            message = ("error", seq, init_error, 0)
        else:
            try:
                message = _load(dataset, indices, collate_fn, seq, block_name, blocks)
            except Exception as e:
                message = ("error", seq, _pack_exception(e, indices), 0)
        try:
            conn.send(message)
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return
        except Exception as e:  # The batch itself could not be pickled.
            try:
                conn.send(("error", seq, _pack_exception(e, indices), 0))
            except OSError:
                return


def _load(dataset, indices, collate_fn, seq, block_name, blocks):
    """One batch, as the message for the main process: arrays in shared memory if
    the lent block fits them, else everything pickled with the size it needs."""
    batch = fetch_batch(dataset, indices, collate_fn)
    size = _shm.packed_size(batch)
    if block_name is not None:
        if block_name not in blocks:
            blocks[block_name] = shared_memory.SharedMemory(name=block_name)
        skeleton = _shm.write(batch, blocks[block_name].buf)
        if skeleton is not None:
            return "shm", seq, skeleton, size
    return "ok", seq, batch, size


def _pack_exception(exc: BaseException, indices: list[int] | None = None) -> dict[str, Any]:
    try:
        pickled = pickle.dumps(exc)
    except Exception:
        pickled = None
    return {
        "pickled": pickled,
        "type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
        "indices": None if indices is None else np.asarray(indices).tolist(),
    }


def _rebuild_exception(packed: dict[str, Any], worker: int, pid: int, seq: int) -> BaseException:
    exc = None
    if packed["pickled"] is not None:
        try:
            exc = pickle.loads(packed["pickled"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = FleetWorkerError(f"{packed['type']}: {packed['message']}")
    where = (
        f"while loading batch {seq} (dataset indices {_short(packed['indices'])})"
        if packed["indices"] is not None
        else "in worker_init_fn"
    )
    exc.__cause__ = _RemoteTraceback(
        f"\n\nTraceback in DataLoader worker {worker} (pid {pid}):\n{packed['traceback']}"
    )
    exc.add_note(
        f"Raised in DataLoader worker {worker} (pid {pid}) {where}; the worker's traceback "
        "is printed above. Run with num_workers=0 to debug it in the main process."
    )
    return exc


def _short(indices: list[int], limit: int = 8) -> str:
    if len(indices) <= limit:
        return str(indices)
    return f"[{', '.join(map(str, indices[:limit]))}, ... ({len(indices)} in all)]"
