"""Batch samplers: which dataset indices make up each batch, epoch by epoch.

The index arithmetic is two pure functions, :func:`padded_order` and
:func:`batch_slices`; the samplers are thin stateful shells that add the epoch
counter and mid-epoch resume. Both samplers yield lists of ints (Paddle's
``paddle.io.BatchSampler`` / ``DistributedBatchSampler``).

Where iteration stands is one :class:`Position` (an epoch and the batches handed
out in it), held by the sampler and advanced by whoever hands the batches out: the
sampler's own iterator, or the ``DataLoader``, which counts a batch when the user
receives it (not when it is loaded ahead). ``state_dict()`` reads it, and
``set_state_dict()`` puts a restored one in place.

How :class:`DistributedBatchSampler` splits an epoch (Paddle's algorithm):

1. Pad ``range(n)`` to ``total_size``, the next multiple of ``num_replicas``, by
   repeating indices from its start, cyclically when ``n < num_replicas``:
   ``order = [0, 1, ..., n-1, 0, 1, ...]``.
2. With ``shuffle=True``, shuffle that padded list in place with
   ``numpy.random.RandomState(epoch).shuffle`` -- the same on every replica.
3. Split batch-strided: in every full window of ``batch_size * num_replicas``
   indices, replica ``r`` takes the ``r``-th block of ``batch_size``; the
   remainder (a multiple of ``num_replicas``) is cut into ``num_replicas`` equal
   contiguous pieces, one last, smaller batch per replica. ``drop_last`` drops
   that last partial batch on every replica.

So step ``k``'s batches of all replicas, in replica order, are one contiguous run
of ``order``: the global batch a ``BatchSampler(batch_size * num_replicas)`` over
``order`` would give.

Where this differs from Paddle's code: Paddle pads with ``indices[:total - n]``,
which comes up short when ``n < num_replicas / 2`` (fleet pads cyclically); Paddle
advances ``epoch`` only when shuffling (fleet on every iteration, which changes
nothing without shuffle); Paddle's ``BatchSampler(shuffle=True)`` draws from numpy's
global RNG (fleet's from ``RandomState(epoch)``, so it can resume).
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any

import numpy as np

from fleet._errors import FleetConfigError, FleetTypeError

# --------------------------------------------------------------------------- pure core


def padded_order(
    dataset_size: int, num_replicas: int, epoch: int, shuffle: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's index order, padded to a multiple of ``num_replicas``.

    Returns:
        ``(order, is_padding)``: ``order[j]`` is the dataset index at position ``j``;
        ``is_padding[j]`` marks the repeated entries added by the padding (their
        position in the list before shuffling is ``>= dataset_size``).

    Example:
        >>> order, pad = padded_order(5, 4, epoch=0, shuffle=False)
        >>> order.tolist(), pad.tolist()
        ([0, 1, 2, 3, 4, 0, 1, 2], [False, False, False, False, False, True, True, True])
    """
    total = -(-dataset_size // num_replicas) * num_replicas
    positions = np.arange(total)
    if shuffle:
        np.random.RandomState(epoch).shuffle(positions)
    return positions % dataset_size, positions >= dataset_size


def batch_slices(
    total_size: int, batch_size: int, num_replicas: int, first: int, count: int, drop_last: bool
) -> list[slice]:
    """Where the batches of replicas ``[first, first + count)`` lie in the padded order.

    Step ``k``'s slice holds those replicas' ``k``-th batches, concatenated in
    replica order (``count`` blocks of ``batch_size``, or of the last partial size).
    ``first=0, count=num_replicas`` gives the global batches.

    Example:
        >>> batch_slices(10, batch_size=2, num_replicas=2, first=1, count=1, drop_last=False)
        [slice(2, 4, None), slice(6, 8, None), slice(9, 10, None)]
    """
    window = batch_size * num_replicas
    full, tail = divmod(total_size, window)
    slices = [
        slice(k * window + first * batch_size, k * window + (first + count) * batch_size)
        for k in range(full)
    ]
    last = tail // num_replicas
    if last and not drop_last:
        start = full * window
        slices.append(slice(start + first * last, start + (first + count) * last))
    return slices


# --------------------------------------------------------------------------- samplers


class BatchSampler:
    """Groups dataset indices into batches (Paddle's ``paddle.io.BatchSampler``).

    Give either ``dataset`` (indices ``0..len(dataset)-1``, shuffled when
    ``shuffle=True``) or ``sampler`` (any sized iterable of indices, taken in its
    order). The shuffle is ``numpy.random.RandomState(epoch).permutation``, so it
    is reproducible; ``epoch`` advances by one each time iteration starts and
    :meth:`set_epoch` sets it. :meth:`state_dict` / :meth:`set_state_dict` resume
    mid-epoch.

    Args:
        dataset: a sized dataset; mutually exclusive with ``sampler``.
        sampler: a sized iterable of indices; mutually exclusive with ``dataset``.
        shuffle: shuffle ``dataset``'s indices each epoch (only with ``dataset``).
        batch_size: indices per batch.
        drop_last: drop the last batch when it is smaller than ``batch_size``.

    Example:
        >>> list(BatchSampler(sampler=range(5), batch_size=2))
        [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self,
        dataset: Sized | None = None,
        sampler: Iterable[int] | None = None,
        shuffle: bool = False,
        batch_size: int = 1,
        drop_last: bool = False,
    ):
        if (dataset is None) == (sampler is None):
            raise FleetConfigError(
                "BatchSampler needs exactly one of dataset= or sampler=, got "
                f"{'both' if dataset is not None else 'neither'}"
            )
        if sampler is not None and shuffle:
            raise FleetConfigError(
                "BatchSampler(sampler=..., shuffle=True): the sampler fixes the order; "
                "shuffle inside the sampler, or pass dataset= with shuffle=True"
            )
        self.dataset = dataset
        self.sampler = sampler
        self.shuffle = bool(shuffle)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.drop_last = bool(drop_last)
        self._size = _dataset_size(dataset if dataset is not None else sampler)
        self.epoch = 0  # the epoch the next iteration starts (unless one is restored)
        self._position: Position | None = None  # the running, or a restored, epoch
        if not isinstance(self, DistributedBatchSampler):  # it checks once it knows its split
            self._check_not_empty()

    def _check_not_empty(self) -> None:
        """``drop_last`` with a batch larger than the data would give no batch at all."""
        if self.drop_last and self._size and len(self) == 0:
            share = self._total_size() // getattr(self, "num_replicas", 1)
            where = (f"{self._size} samples" if share == self._size else
                     f"{self._size} samples split over {self.num_replicas} replicas ({share} "
                     "each)")
            raise FleetConfigError(
                f"{type(self).__name__}(batch_size={self.batch_size}, drop_last=True) over "
                f"{where} gives no batch: the only batch is partial and drop_last drops it; "
                f"use batch_size <= {share}, or drop_last=False"
            )

    # Subclasses change these two.
    def _order(self, epoch: int) -> np.ndarray:
        if self.sampler is not None:
            return np.asarray(list(self.sampler), dtype=np.int64)
        if self.shuffle:
            return np.random.RandomState(epoch).permutation(self._size)
        return np.arange(self._size)

    def _slices(self, total_size: int) -> list[slice]:
        return batch_slices(total_size, self.batch_size, 1, 0, 1, self.drop_last)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of ``epoch``, as index arrays (pure: no state changes).

        Example:
            >>> [b.tolist() for b in BatchSampler(sampler=range(3), batch_size=2).batches(0)]
            [[0, 1], [2]]
        """
        order = self._order(epoch)
        return [order[s] for s in self._slices(len(order))]

    def __iter__(self):
        position, batches = self.start_epoch()
        return _hand_out(batches, position)

    def start_epoch(self) -> tuple[Position, list[np.ndarray]]:
        """Starts the next epoch: its :class:`Position` and its batches (index arrays).

        The position is where a restored state stopped (:meth:`set_state_dict`), or
        the start of epoch ``self.epoch``; ``self.epoch`` moves on to the next one.
        The caller hands out ``batches[position.done:]`` and counts each batch in
        ``position.done`` as it hands it out (so :meth:`state_dict` is exact), and
        sets ``position.finished`` at the end. This is what ``DataLoader`` does.

        Example:
            >>> s = BatchSampler(sampler=range(5), batch_size=2)
            >>> position, batches = s.start_epoch()
            >>> position.epoch, [b.tolist() for b in batches], s.epoch
            (0, [[0, 1], [2, 3], [4]], 1)
        """
        restored = self._position
        if restored is not None and not restored.started and restored.epoch == self.epoch:
            position = restored
        else:
            position = Position(self.epoch, 0)
        position.started = True
        self._position = position
        self.epoch = position.epoch + 1
        return position, self.batches(position.epoch)

    def __len__(self) -> int:
        return len(self._slices(self._total_size()))

    def _total_size(self) -> int:
        return self._size

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next iteration uses (and that seeds its shuffle).

        A resume state loaded with :meth:`set_state_dict` stays pending only if
        ``epoch`` is the saved epoch.
        """
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool) or epoch < 0:
            raise FleetConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: ``{"epoch", "batches_done"}`` plus the config it needs.

        During an epoch this is the running epoch and the number of batches yielded
        so far; between epochs it is the next epoch and 0.
        """
        position = self._position
        if position is not None and (
                (position.started and not position.finished and position.done < len(self))
                or (not position.started and position.epoch == self.epoch)):
            epoch, done = position.epoch, position.done  # running, or restored
        else:
            epoch, done = self.epoch, 0
        return {"epoch": epoch, "batches_done": done, **self._fingerprint()}

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue exactly after the saved state's last batch.

        Example:
            >>> s = BatchSampler(sampler=range(6), batch_size=2)
            >>> it = iter(s); first = next(it)
            >>> t = BatchSampler(sampler=range(6), batch_size=2)
            >>> t.set_state_dict(s.state_dict()); list(t)
            [[2, 3], [4, 5]]
        """
        missing = {"epoch", "batches_done"} - set(state)
        if missing:
            raise FleetConfigError(
                f"sampler state is missing {sorted(missing)}; pass what state_dict() returned"
            )
        for key, mine in self._fingerprint().items():
            if key in state and state[key] != mine:
                raise FleetConfigError(
                    f"the sampler state was saved with {key}={state[key]!r} but this "
                    f"sampler has {key}={mine!r}; resume with the same dataset, batch size "
                    "and number of replicas, or start the epoch over"
                )
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        if not 0 <= done <= len(self):
            raise FleetConfigError(
                f"batches_done={done} is outside 0..{len(self)} (this sampler's batches "
                "per epoch); pass what state_dict() returned"
            )
        self.epoch = epoch
        self._position = Position(epoch, done)

    def _fingerprint(self) -> dict[str, Any]:
        return {"dataset_size": self._size, "batch_size": self.batch_size}


class DistributedBatchSampler(BatchSampler):
    """Each replica's share of every batch (Paddle's ``DistributedBatchSampler``).

    See this module's docstring for the exact split. ``batch_size`` is per replica,
    and a replica is a device. This process covers replicas
    ``[rank, rank + num_local_replicas)``; each yielded batch is their batches
    concatenated in replica (device) order, ``batch_size * num_local_replicas``
    indices (fewer in a last partial batch). ``len()`` is the same on every replica.

    Defaults, resolved when the sampler is built:

    * after ``fleet.init``: ``num_replicas`` = all devices of all processes, ``rank`` =
      the mesh index of this process's first device, ``num_local_replicas`` = this
      process's devices -- the split ``fleet.io.DataLoader`` expects;
    * without ``fleet.init``: one replica, ``rank=0``;
    * an explicit ``rank`` (Paddle's one-replica-per-process style) means
      ``num_local_replicas=1``.

    Args:
        dataset: a sized dataset.
        batch_size: samples per replica per step.
        num_replicas: number of replicas the data is split over.
        rank: index of this process's first replica.
        shuffle: shuffle the padded index list with ``RandomState(epoch)``.
        drop_last: drop each replica's last partial batch.
        num_local_replicas: how many consecutive replicas this process covers.

    Example:
        >>> s = DistributedBatchSampler(range(10), batch_size=2, num_replicas=2, rank=1)
        >>> list(s), len(s)
        ([[2, 3], [6, 7], [9]], 3)
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
        *,
        num_local_replicas: int | None = None,
    ):
        super().__init__(dataset=dataset, shuffle=shuffle, batch_size=batch_size,
                         drop_last=drop_last)
        if self._size == 0:
            raise FleetConfigError(
                "DistributedBatchSampler got an empty dataset (len 0); there is nothing "
                "to split over the replicas"
            )
        self.num_replicas, self.rank, self.num_local_replicas = _resolve_replicas(
            num_replicas, rank, num_local_replicas
        )
        self.num_samples = -(-self._size // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._check_not_empty()
        self._agreed = False

    def _order(self, epoch: int) -> np.ndarray:
        return padded_order(self._size, self.num_replicas, epoch, self.shuffle)[0]

    def _slices(self, total_size: int) -> list[slice]:
        return batch_slices(total_size, self.batch_size, self.num_replicas, self.rank,
                            self.num_local_replicas, self.drop_last)

    def _total_size(self) -> int:
        return self.total_size

    def start_epoch(self) -> tuple[Position, list[np.ndarray]]:
        if not self._agreed:
            self._agree_on_length()
            self._agreed = True
        return super().start_epoch()

    def _agree_on_length(self) -> None:
        """Every process must split the same index list; a dataset of another length on
        one process would give it another number of batches, and the job would hang in
        the step after the shorter process's last batch."""
        from fleet import _world

        if not _world.is_initialized() or self.num_local_replicas == self.num_replicas:
            return  # this process feeds every replica: nobody to agree with
        import jax

        from fleet._agree import agree

        if jax.process_count() == 1:
            return
        name = "fleet.io.DistributedBatchSampler.dataset_length"
        lengths = [int(v) for v in agree(name, str(self._size))]
        if len(set(lengths)) > 1:
            _coordinator_last(name)
            by_length: dict[int, list[int]] = {}
            for process, n in enumerate(lengths):
                by_length.setdefault(n, []).append(process)
            told = "; ".join(f"len(dataset) = {n} on process(es) {ps}"
                             for n, ps in by_length.items())
            raise FleetConfigError(
                f"DistributedBatchSampler: the processes' datasets differ in length ({told}); "
                "every process must build the same dataset (the sampler splits it by index), "
                "or the processes get different numbers of batches and the job hangs"
            )

    def padding_mask(self, step: int, epoch: int | None = None) -> np.ndarray:
        """Which rows of step ``step``'s *global* batch are padding duplicates.

        The global batch is every replica's batch of that step in replica order --
        what a global ``jax.Array`` from the loader holds. Dropping the ``True`` rows
        of every step leaves each dataset index exactly once (with ``drop_last=False``).

        Args:
            step: the batch number within the epoch.
            epoch: the epoch whose order to use; default: the running (or last) one.

        Example:
            >>> s = DistributedBatchSampler(range(5), batch_size=2, num_replicas=2, rank=0)
            >>> [s.padding_mask(k, epoch=0).tolist() for k in range(len(s))]
            [[False, False, False, False], [False, True]]
        """
        if epoch is None:
            running = self._position is not None and self._position.started
            epoch = self._position.epoch if running else self.epoch
        order_pad = padded_order(self._size, self.num_replicas, epoch, self.shuffle)[1]
        slices = batch_slices(self.total_size, self.batch_size, self.num_replicas, 0,
                              self.num_replicas, self.drop_last)
        if not 0 <= step < len(slices):
            raise FleetConfigError(
                f"step={step} is outside 0..{len(slices) - 1}, the {len(slices)} batches "
                "of an epoch"
            )
        return order_pad[slices[step]]

    def _fingerprint(self) -> dict[str, Any]:
        return {**super()._fingerprint(), "num_replicas": self.num_replicas,
                "shuffle": self.shuffle, "drop_last": self.drop_last}


# --------------------------------------------------------------------------- helpers


def _coordinator_last(name: str, timeout_s: float = 10.0) -> None:
    """Before every process raises the same error: process 0, whose exit takes JAX's
    key-value service down with it, waits until every other process has read what
    it needs (each sets a key once done), so each raises its own error instead of
    dying in a read when the service goes away."""
    import jax

    from fleet import _compat

    client, rank = _compat.distributed_client(), jax.process_index()
    prefix = f"fleet/agree/{name}/raising/"
    try:
        client.key_value_set(prefix + str(rank), "1")
        if rank == 0:
            for other in range(1, jax.process_count()):
                client.blocking_key_value_get(prefix + str(other), int(timeout_s * 1000))
    except Exception:  # noqa: BLE001 (best effort: the error is raised either way)
        pass


class Position:
    """Where iteration stands: ``epoch`` and ``done``, the batches of it handed out.

    ``started``: the epoch is running (else it is a restored position, waiting for
    the next iteration); ``finished``: every batch was handed out.
    """

    __slots__ = ("epoch", "done", "started", "finished")

    def __init__(self, epoch: int, done: int):
        self.epoch, self.done, self.started, self.finished = epoch, done, False, False

    def __repr__(self) -> str:
        return (f"Position(epoch={self.epoch}, done={self.done}, started={self.started}, "
                f"finished={self.finished})")


def _hand_out(batches: list[np.ndarray], position: Position):
    for batch in batches[position.done:]:
        position.done += 1
        yield batch.tolist()
    position.finished = True


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise FleetTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise FleetConfigError(f"{name}={value} must be at least 1")
    return int(value)


def _dataset_size(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise FleetTypeError(
            f"{type(dataset).__name__} has no len(); a sampler needs a map-style dataset "
            "(define __len__ and __getitem__) or a sized sampler"
        ) from None
    except (ValueError, OverflowError):  # __len__ returned a negative (or huge) number
        raise FleetConfigError(
            f"len() of the {type(dataset).__name__} is {type(dataset).__len__(dataset)!r}; "
            "__len__ must return the number of samples, an int >= 0"
        ) from None


def _resolve_replicas(
    num_replicas: int | None, rank: int | None, num_local_replicas: int | None
) -> tuple[int, int, int]:
    from fleet import _world

    world = _world.world() if _world.is_initialized() else None
    if num_replicas is None:
        num_replicas = world.num_replicas if world is not None else 1
    num_replicas = _positive_int("num_replicas", num_replicas)
    per_device = world is not None and rank is None and num_replicas == world.num_replicas
    if num_local_replicas is None:
        num_local_replicas = world.num_local_replicas if per_device else 1
    num_local_replicas = _positive_int("num_local_replicas", num_local_replicas)
    if rank is None:
        if per_device:
            rank = _world.first_local_replica(world)
        elif world is not None:
            import jax

            rank = jax.process_index() * num_local_replicas
        else:
            rank = 0
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
        raise FleetTypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
    if not 0 <= rank or rank + num_local_replicas > num_replicas:
        raise FleetConfigError(
            f"rank={rank} with num_local_replicas={num_local_replicas} covers replicas "
            f"[{rank}, {rank + num_local_replicas}), outside the {num_replicas} replicas "
            f"(allowed ranks: 0..{num_replicas - num_local_replicas}); leave rank and "
            "num_replicas as None to take them from fleet.init"
        )
    return num_replicas, int(rank), num_local_replicas
