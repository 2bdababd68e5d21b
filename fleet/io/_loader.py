"""``DataLoader``: batches from a dataset, placed on the mesh as global ``jax.Array``s.

The pipeline for one batch: the batch sampler gives this process's indices ->
the samples are fetched and stacked (in a background thread, or in worker
processes; ``fleet/io/_pipeline.py``) -> the process-local rows are placed on
this process's devices as a global array sharded over the ``data`` axis
(``fleet/io/_placement.py``).

The loader holds no position (``fleet/io/_position.py``): ``state_dict()`` is the
sampler's, which reads the running iterator (a batch sampler of your own has
none, so the loader reads the iterator itself), and ``set_state_dict()`` gives
the next iteration its start.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.io._errors import FleetDataError
from fleet.io._pipeline import (
    InlineProducer,
    LoaderIterator,
    ThreadProducer,
    from_workers,
    in_process,
)
from fleet.io._placement import GlobalTransfer, check_sampler_fits_world, gather_to_host
from fleet.io._position import Position, Tracker, resume_point
from fleet.io._sampler import BatchSampler, DistributedBatchSampler
from fleet.io._sampler_args import int_at_least
from fleet.io._workers import WorkerPool
from fleet.runtime._world import world


class DataLoader:
    """Iterates over a dataset in batches ready for ``fleet.distributed_step``.

    Each batch has the structure of a sample (tuple / dict / array) and every array
    is a global ``jax.Array`` sharded with ``fleet.world().batch``: its rows are all
    replicas' batches in replica order, and each device holds its own replica's rows.
    With ``return_numpy=True`` batches stay process-local numpy arrays instead.

    Without ``batch_sampler`` the loader builds
    ``DistributedBatchSampler(dataset, batch_size, shuffle=shuffle, drop_last=drop_last)``:
    ``batch_size`` is per device, as in Paddle where it is per GPU. Datasets with a
    ``get_batch(indices)`` method (e.g. :class:`TensorDataset`) are gathered one batch
    at a time, with no per-sample Python loop, unless ``collate_fn`` is given.

    Args:
        dataset: a map-style dataset (``__len__``, ``__getitem__``).
        batch_size: samples per replica (device) per step; only without ``batch_sampler``.
        shuffle: shuffle every epoch; only without ``batch_sampler``.
        drop_last: drop the last partial batch; only without ``batch_sampler``.
        batch_sampler: yields this process's index lists (e.g. a
            :class:`DistributedBatchSampler`); excludes ``batch_size``, ``shuffle``
            and ``drop_last``.
        num_workers: worker processes for per-sample work (0: load in this process).
            Workers are spawned, so the dataset must be picklable.
        collate_fn: turns a list of samples into a batch (default: stack into numpy).
        prefetch_factor: batches loaded ahead (per worker when ``num_workers > 0``).
        return_numpy: yield process-local numpy batches instead of global arrays.
        worker_init_fn: called as ``worker_init_fn(worker_id)`` in each new worker.
        persistent_workers: keep the workers between epochs (closed by :meth:`close`,
            or when an epoch is left early).
        use_buffer_reader: load ahead in a background thread (Paddle's option of the
            same name). ``None`` (default): a thread for per-sample loading and for
            workers; the vectorised fast path loads in the main thread when asked
            (see below). ``True`` / ``False`` force it on / off.

    Starting a new iteration stops the previous one of the same loader (they share
    the sampler's epoch). Leaving the loop early, an exception in it, or Ctrl-C
    stops the background thread and the workers: no process is left behind.

    Example:
        >>> import numpy as np, fleet
        >>> from fleet.io import DataLoader, TensorDataset
        >>> world = fleet.init(is_collective=True)
        >>> ds = TensorDataset([np.zeros((64, 3), np.float32), np.arange(64)])
        >>> loader = DataLoader(ds, batch_size=2, shuffle=True, drop_last=True)
        >>> x, y = next(iter(loader))
        >>> x.shape == (2 * world.num_replicas, 3) and x.sharding == world.batch
        True
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        batch_sampler: Iterable[list[int]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        prefetch_factor: int = 2,
        *,
        return_numpy: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        persistent_workers: bool = False,
        use_buffer_reader: bool | None = None,
    ):
        if not (hasattr(dataset, "__getitem__") or hasattr(dataset, "get_batch")):
            raise FleetTypeError(
                f"DataLoader needs a map-style dataset (with __getitem__ and __len__), got "
                f"{type(dataset).__name__}; subclass fleet.io.Dataset or use TensorDataset"
            )
        if batch_sampler is None:
            batch_sampler = DistributedBatchSampler(
                dataset, batch_size, shuffle=shuffle, drop_last=drop_last
            )
        elif batch_size != 1 or shuffle or drop_last:
            raise FleetConfigError(
                f"DataLoader got batch_sampler together with batch_size={batch_size}, "
                f"shuffle={shuffle}, drop_last={drop_last}; the batch sampler decides "
                "those: set them on the sampler and leave them at their defaults here"
            )
        num_workers = int_at_least("num_workers", num_workers, 0)
        prefetch_factor = int_at_least("prefetch_factor", prefetch_factor)
        for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
            if fn is not None and not callable(fn):
                raise FleetTypeError(f"{name} must be callable or None, got {fn!r}")
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.prefetch_factor = prefetch_factor
        self.return_numpy = bool(return_numpy)
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = bool(persistent_workers)
        self.use_buffer_reader = use_buffer_reader
        if not self.return_numpy:
            check_sampler_fits_world(batch_sampler, world())
        self._tracker = Tracker()  # reads the last iteration (gather_for_metrics, state)
        self._restored: Position | None = None  # a batch sampler of your own: its start
        self._current: weakref.ref | None = None
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __call__(self) -> Iterator[Any]:
        """``loader()`` is ``iter(loader)``, as Paddle's ``for data in train_loader():``."""
        return iter(self)

    def __iter__(self) -> Iterator[Any]:
        self._close_current()
        here = None if self.return_numpy else world()
        sampler = self.batch_sampler
        if isinstance(sampler, BatchSampler):
            start = sampler.start_epoch()
            indices = iter(sampler.batches(start.epoch)[start.done:])  # no list round trip
        else:  # a batch sampler of your own: no epochs; a restored start skips batches
            start, self._restored = resume_point(self._restored, 0), None
            indices = itertools.islice(iter(sampler), start.done, None)

        pool, owns_pool = None, False
        if self.num_workers > 0:
            pool, owns_pool = self._worker_pool()
            source = from_workers(pool, indices, self.prefetch_factor * self.num_workers)
        else:
            source = in_process(self.dataset, indices, self.collate_fn)
        transfer = None
        if here is not None:
            transfer = GlobalTransfer(here.batch, here.num_local_replicas, start.done)
        if self._threaded():
            producer, lookahead = ThreadProducer(source, self.prefetch_factor), 1
        else:
            producer, lookahead = InlineProducer(source), 0
        iterator = LoaderIterator(producer, transfer, lookahead, pool, owns_pool, start,
                                  len(self))
        if isinstance(sampler, BatchSampler):
            sampler.follow(iterator)
        self._tracker = Tracker()
        self._tracker.follow(iterator)
        self._current = weakref.ref(iterator)
        return iterator

    def _threaded(self) -> bool:
        if self.use_buffer_reader is not None:
            return bool(self.use_buffer_reader)
        fast_path = self.collate_fn is None and hasattr(self.dataset, "get_batch")
        return self.num_workers > 0 or not fast_path

    def _worker_pool(self) -> tuple[WorkerPool, bool]:
        """The persistent pool if one is alive, else a new one; and whether the
        iteration owns it (closes it at its end)."""
        if self._pool is not None and not self._pool.closed:
            return self._pool, False
        pool = WorkerPool(self.dataset, self.collate_fn, self.num_workers,
                          self.worker_init_fn, int(np.random.randint(2**31)),
                          max_in_flight=self.prefetch_factor * self.num_workers)
        if not self.persistent_workers:
            return pool, True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._pool = pool
        self._finalizer = weakref.finalize(self, pool.close)
        return pool, False

    def close(self) -> None:
        """Stops the running iteration and any persistent workers."""
        self._close_current()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, counting only batches already handed out.

        Batches loaded ahead but not yet yielded are not counted, so a job restarted
        from this state with :meth:`set_state_dict` continues with exactly the next
        batch. Save it together with the model.

        Example:
            >>> import numpy as np
            >>> from fleet.io import BatchSampler, DataLoader, TensorDataset
            >>> ds = TensorDataset([np.arange(8)])
            >>> pairs = BatchSampler(dataset=ds, batch_size=2)
            >>> loader = DataLoader(ds, batch_sampler=pairs, return_numpy=True)
            >>> it = iter(loader); _ = next(it)
            >>> loader.state_dict()["sampler"]["batches_done"]
            1
        """
        if isinstance(self.batch_sampler, BatchSampler):
            return {"sampler": self.batch_sampler.state_dict()}
        last = self._tracker.last()
        if last is not None and not last.finished:
            return {"batches_done": last.done}  # running, or stopped before the end
        return {"batches_done": resume_point(self._restored, 0).done}

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue after the last batch counted in ``state``."""
        self._close_current()
        if isinstance(self.batch_sampler, BatchSampler):
            if "sampler" not in state:
                raise FleetConfigError(
                    f"loader state has keys {sorted(state)}, expected 'sampler'; pass what "
                    "DataLoader.state_dict() returned"
                )
            self.batch_sampler.set_state_dict(state["sampler"])
        else:
            self._restored = Position(0, int(state["batches_done"]))
        self._tracker = Tracker()

    def gather_for_metrics(self, outputs: Any, step: int | None = None) -> Any:
        """Per-example ``outputs`` of the last batch, gathered to host, padding dropped.

        :class:`DistributedBatchSampler` pads the dataset with repeated samples so
        every replica gets the same number; counting those would skew metrics. Call
        this once per batch, inside the loop, with arrays whose leading axis is the
        global batch just yielded (e.g. predictions and labels). It returns numpy
        arrays (every process gets all rows) without the padding rows, so over an
        epoch each dataset sample is counted exactly once.

        Args:
            outputs: a pytree of arrays with one row per global batch row (a global
                ``jax.Array``, or this process's rows as numpy).
            step: the batch of the running epoch the outputs belong to (default: the
                one just yielded); for outputs fetched a step later, so that the
                device need not wait for the host.

        Returns:
            The same pytree as numpy arrays, padding rows removed.

        Example:
            >>> import numpy as np, fleet
            >>> from fleet.io import DataLoader, TensorDataset
            >>> world = fleet.init(is_collective=True)
            >>> ds = TensorDataset([np.arange(10)])
            >>> loader = DataLoader(ds, batch_size=1)
            >>> seen = [loader.gather_for_metrics(x) for (x,) in loader]
            >>> sorted(np.concatenate(seen).tolist()) == list(range(10))
            True
        """
        last = self._tracker.last()
        if last is None or last.done == last.first:
            raise FleetConfigError(
                "gather_for_metrics() was called before the loader yielded a batch; call "
                "it inside the loop, once per batch, with that batch's outputs"
            )
        if step is None:
            step = last.done - 1
        elif not last.first <= step < last.done:
            raise FleetConfigError(
                f"gather_for_metrics(step={step}): this iteration has yielded batches "
                f"{last.first}..{last.done - 1}; pass one of those"
            )
        host = jax.tree_util.tree_map(gather_to_host, outputs)
        if not hasattr(self.batch_sampler, "padding_mask"):
            return host
        keep = ~self.batch_sampler.padding_mask(step, last.epoch)

        def drop(a):
            if a.ndim == 0 or len(a) != len(keep):
                raise FleetDataError(
                    f"gather_for_metrics got an array of shape {a.shape}, but batch {step} "
                    f"has {len(keep)} rows; pass per-example outputs of the batch just "
                    "yielded (leading axis = its global batch size)"
                )
            return a[keep]

        return jax.tree_util.tree_map(drop, host)

    def _close_current(self) -> None:
        current = self._current() if self._current is not None else None
        if current is not None:
            current.close()
        self._current = None
