"""``DataLoader``: batches from a dataset, placed on the mesh as global ``jax.Array``s.

The pipeline for one batch: the batch sampler gives this process's indices ->
the samples are fetched and stacked (in a background thread, or in worker
processes) -> ``jax.make_array_from_process_local_data`` places the process-local
rows on this process's devices, giving a global array sharded over the ``data``
axis (``fleet.world().batch``).

How batches are loaded ahead and overlap the training step: ``fleet/io/_pipeline.py``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from fleet import _world
from fleet._errors import FleetConfigError, FleetTypeError
from fleet.io._errors import FleetDataError
from fleet.io._pipeline import (
    InlineProducer,
    LoaderIterator,
    ThreadProducer,
    from_workers,
    in_process,
)
from fleet.io._sampler import BatchSampler, DistributedBatchSampler, Position
from fleet.io._workers import WorkerPool


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
        for name, value, low in (("num_workers", num_workers, 0), ("prefetch_factor",
                                                                    prefetch_factor, 1)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise FleetTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise FleetConfigError(f"{name}={value} must be at least {low}")
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
            _check_sampler_fits_world(batch_sampler, _world.world())
        # Where iteration stands: the sampler's Position (a fleet sampler keeps it), or,
        # for a batch sampler of your own, one the loader keeps. Advanced as batches are
        # handed out; _first is where the running iteration began.
        self._position: Position | None = None
        self._first = 0
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
        to_host = self.return_numpy
        world = None if to_host else _world.world()
        if isinstance(self.batch_sampler, BatchSampler):
            position, batches = self.batch_sampler.start_epoch()
            indices = iter(batches[position.done:])  # index arrays, no list round trip
        else:  # a batch sampler of your own: the loader keeps the position (no epochs)
            restored = self._position
            fresh = restored is None or restored.started
            position = Position(0, 0) if fresh else restored
            position.started = True
            indices = itertools.islice(iter(self.batch_sampler), position.done, None)
        self._position, self._first = position, position.done

        pool, owns_pool = None, False
        if self.num_workers > 0:
            pool, owns_pool = self._worker_pool()
            source = from_workers(pool, indices, self.prefetch_factor * self.num_workers)
        else:
            source = in_process(self.dataset, indices, self.collate_fn)
        if to_host:
            transfer = None
        else:
            transfer = _GlobalTransfer(world.batch, world.num_local_replicas, position.done)
        if self._threaded():
            producer, lookahead = ThreadProducer(source, self.prefetch_factor), 1
        else:
            producer, lookahead = InlineProducer(source), 0
        iterator = LoaderIterator(producer, transfer, lookahead, pool, owns_pool, position,
                                  len(self))
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
        position = self._position
        running = position is not None and not position.finished
        return {"batches_done": position.done if running else 0}

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
            self._position = None
        else:
            self._position = Position(0, int(state["batches_done"]))

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
        position = self._position
        if position is None or not position.started or position.done == self._first:
            raise FleetConfigError(
                "gather_for_metrics() was called before the loader yielded a batch; call "
                "it inside the loop, once per batch, with that batch's outputs"
            )
        if step is None:
            step = position.done - 1
        elif not self._first <= step < position.done:
            raise FleetConfigError(
                f"gather_for_metrics(step={step}): this iteration has yielded batches "
                f"{self._first}..{position.done - 1}; pass one of those"
            )
        host = jax.tree_util.tree_map(to_host, outputs)
        if not hasattr(self.batch_sampler, "padding_mask"):
            return host
        keep = ~self.batch_sampler.padding_mask(step, position.epoch)

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


class _GlobalTransfer:
    """Places a process-local numpy batch on the mesh as global arrays.

    All numeric leaves go in one ``jax.make_array_from_process_local_data`` call
    (one batched transfer); strings and other non-numeric leaves stay on the host.
    """

    def __init__(self, sharding, num_local: int, first_step: int):
        self.sharding, self.num_local, self.step = sharding, num_local, first_step

    def __call__(self, batch: Any) -> Any:
        step = self.step
        self.step += 1
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        numeric = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, (str, bytes)) or not hasattr(leaf, "__array__"):
                continue
            leaf = np.asarray(leaf)
            if leaf.dtype.kind not in "biufc":
                continue
            if leaf.ndim == 0 or leaf.shape[0] % self.num_local:
                raise FleetDataError(
                    f"batch {step} has an array of shape {leaf.shape}, whose leading axis "
                    f"does not split over this process's {self.num_local} devices; use a "
                    "DistributedBatchSampler (batch_size is then per device), or "
                    "drop_last=True, or return_numpy=True"
                )
            leaves[i] = leaf
            numeric.append(i)
        if not numeric:
            return batch
        placed = jax.make_array_from_process_local_data(
            self.sharding, [leaves[i] for i in numeric]
        )
        for i, array in zip(numeric, placed):
            leaves[i] = array
        return jax.tree_util.tree_unflatten(treedef, leaves)


def to_host(x: Any) -> np.ndarray:
    """``x`` as a numpy array with every process's rows (a global array is gathered)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if not isinstance(x, jax.Array) and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
    return np.asarray(x)


def _check_sampler_fits_world(sampler: Any, world: _world.World) -> None:
    """A sampler feeding global arrays must give each process its own, disjoint share."""
    if isinstance(sampler, DistributedBatchSampler):
        per_device = (sampler.num_replicas == world.num_replicas
                      and sampler.num_local_replicas == world.num_local_replicas
                      and sampler.rank == _world.first_local_replica(world))
        per_process = (sampler.num_replicas == jax.process_count()
                       and sampler.num_local_replicas == 1
                       and sampler.rank == jax.process_index())
        if not (per_device or per_process):
            raise FleetConfigError(
                f"the DistributedBatchSampler covers replicas [{sampler.rank}, "
                f"{sampler.rank + sampler.num_local_replicas}) of {sampler.num_replicas}, "
                f"but this process feeds devices [{_world.first_local_replica(world)}, "
                f"{_world.first_local_replica(world) + world.num_local_replicas}) of "
                f"{world.num_replicas}; build the sampler after fleet.init with "
                "num_replicas=None and rank=None, or use return_numpy=True"
            )
    elif isinstance(sampler, BatchSampler) and jax.process_count() > 1:
        raise FleetConfigError(
            f"a plain BatchSampler gives every one of the {jax.process_count()} processes "
            "the same batches, so the global batch would repeat them; use "
            "DistributedBatchSampler"
        )
