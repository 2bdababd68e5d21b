"""Batch samplers: which dataset indices make up each batch, epoch by epoch.

Both samplers yield lists of ints (Paddle's ``paddle.io.BatchSampler`` /
``DistributedBatchSampler``). A sampler is a pure order, :meth:`~BatchSampler.batches`
(``fleet/io/_order.py`` has the index arithmetic and Paddle's algorithm), plus an
epoch counter (:meth:`~BatchSampler.set_epoch`) and, after
:meth:`~BatchSampler.set_state_dict`, the position the next iteration starts from.
It holds no running position (``fleet/io/_position.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import numpy as np

from fleet._errors import FleetConfigError
from fleet.io._order import batch_slices, fixed_order, padded_order, padding_rows, plain_order
from fleet.io._position import Iteration, Position, Tracker, resume_point
from fleet.io._sampler_args import agree_on_length, dataset_size, int_at_least, resolve_replicas


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
        self.batch_size = int_at_least("batch_size", batch_size)
        self.drop_last = bool(drop_last)
        self._size = dataset_size(dataset if dataset is not None else sampler)
        self.epoch = 0  # the epoch the next iteration starts (unless one is restored)
        self._restored: Position | None = None  # set_state_dict's start of the next iteration
        self._tracker = Tracker()  # reads the last iteration over this sampler
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
            return fixed_order(self.sampler)
        return plain_order(self._size, epoch, self.shuffle)

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

    def __iter__(self) -> Iterator[list[int]]:
        start = self.start_epoch()
        iterator = _SamplerIterator(start, self.batches(start.epoch))
        self.follow(iterator)
        return iterator

    def start_epoch(self) -> Position:
        """Starts the next iteration: where it begins, and ``self.epoch`` moves on.

        It begins where a restored state stopped (:meth:`set_state_dict`), or at
        the first batch of epoch ``self.epoch``. The caller hands out
        ``batches(start.epoch)[start.done:]`` from an iterator that holds the
        position (an :class:`~fleet.io._position.Iteration`) and passes that
        iterator to :meth:`follow`. This is what ``iter(sampler)`` and
        ``DataLoader`` do.

        Example:
            >>> s = BatchSampler(sampler=range(5), batch_size=2)
            >>> start = s.start_epoch()
            >>> start, [b.tolist() for b in s.batches(start.epoch)[start.done:]], s.epoch
            (Position(epoch=0, done=0), [[0, 1], [2, 3], [4]], 1)
        """
        start = resume_point(self._restored, self.epoch)
        self._restored, self._tracker = None, Tracker()
        self.epoch = start.epoch + 1
        return start

    def follow(self, iteration: Iteration) -> None:
        """:meth:`state_dict` reports where ``iteration`` stands, the iteration that
        :meth:`start_epoch` began (read through a weak reference, never stored)."""
        self._tracker.follow(iteration)

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
        last = self._tracker.last()
        if last is not None and not last.finished and last.done < len(self):
            epoch, done = last.epoch, last.done  # running, or stopped before the epoch's end
        else:
            epoch, done = resume_point(self._restored, self.epoch)  # restored, or the next
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
        self._restored, self._tracker = Position(epoch, done), Tracker()

    def _fingerprint(self) -> dict[str, Any]:
        return {"dataset_size": self._size, "batch_size": self.batch_size}


class DistributedBatchSampler(BatchSampler):
    """Each replica's share of every batch (Paddle's ``DistributedBatchSampler``).

    ``fleet/io/_order.py`` has the exact split. ``batch_size`` is per replica,
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
        self.num_replicas, self.rank, self.num_local_replicas = resolve_replicas(
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

    def start_epoch(self) -> Position:
        if not self._agreed:  # collective, once: every process splits the same length
            agree_on_length(self._size, self.num_replicas, self.num_local_replicas)
            self._agreed = True
        return super().start_epoch()

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
            last = self._tracker.last()
            epoch = last.epoch if last is not None else self.epoch
        masks = padding_rows(self._size, self.batch_size, self.num_replicas, epoch,
                             self.shuffle, self.drop_last)
        if not 0 <= step < len(masks):
            raise FleetConfigError(
                f"step={step} is outside 0..{len(masks) - 1}, the {len(masks)} batches "
                "of an epoch"
            )
        return masks[step]

    def _fingerprint(self) -> dict[str, Any]:
        return {**super()._fingerprint(), "num_replicas": self.num_replicas,
                "shuffle": self.shuffle, "drop_last": self.drop_last}


class _SamplerIterator(Iteration):
    """``iter(sampler)``: its epoch's batches as lists of ints, from the start position
    on; it holds the position and counts each batch as it hands it out."""

    def __init__(self, start: Position, batches: list[np.ndarray]):
        super().__init__(start, len(batches))
        self._batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self.finished or self.done >= self.length:
            self._stop(finished=True)
            raise StopIteration
        batch = self._batches[self.done]
        self.done += 1
        return batch.tolist()
