"""``fleet.CheckpointManager``: whole training states, numbered by step, on orbax;
the public class, its save policy, and what each call checks first.

Layout: ``directory/<step>/`` holds one orbax item per part (``model``,
``optimizer``, ``state``, ``rng``: arrays in tensorstore's OCDBT format, each
shard written once, by the process that holds it) and ``meta`` (JSON:
:mod:`fleet.checkpoint._meta`). No pickle anywhere.

Crash safety is orbax's commit protocol: a step is written under a temporary
name (``<step>.orbax-checkpoint-tmp-*``) and renamed to ``<step>`` only after
every process finished writing it, so a kill at any moment leaves the earlier
steps intact and a half-written step is never listed. Older steps are deleted
(``max_to_keep``) only once a newer one is committed. Elsewhere: the directory's
lock and what an earlier writer left (:mod:`fleet.checkpoint._open`), a save in
flight (:mod:`fleet.checkpoint._pending`), restoring
(:mod:`fleet.checkpoint._restore`), what ``save`` and ``restore`` take
(:class:`fleet.checkpoint._state.Contents`).

Here: which steps are written (``save_interval_steps``, ``save_interval_seconds``,
``force``), that a saved step is overwritten only with ``force``, and each call's
checks: its arguments, and that every process makes it
(:func:`fleet.checkpoint._state.meet`, a bounded wait instead of a hang in
orbax's barriers).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any

import jax
import orbax.checkpoint as ocp

from fleet.checkpoint import _integrity, _meta, _open, _restore
from fleet.checkpoint._errors import FleetCheckpointError
from fleet.checkpoint._pending import PendingSave, async_option
from fleet.checkpoint._restore import Restored
from fleet.checkpoint._state import Contents, meet, positive, step_number, takes_contents
from fleet.runtime import _agree
from fleet.runtime._world import world


class CheckpointManager:
    """Saves and restores whole training states; keeps the last ``max_to_keep``.

    Collective: every process of the job must create the manager and call
    :meth:`save`, :meth:`restore`, :meth:`restore_latest`,
    :meth:`wait_until_finished` and :meth:`close` with the same arguments (never
    under ``if fleet.is_first_worker():``). Each of these first meets the other
    processes and waits at most ``FLEET_AGREE_TIMEOUT`` seconds (60): a process
    that does not make the call ends the others with a
    :class:`fleet.runtime._agree.FleetTimeoutError` naming the call and its rank. All
    processes must see ``directory``: one machine's disk, or a shared file system.
    A directory has one writer at a time: while this manager is open (until
    :meth:`close`), a manager of another job on ``directory`` is refused.

    Args:
        directory: where the steps are written (created if missing; not a file).
        max_to_keep: keep only the newest ``max_to_keep`` steps (``None``: all);
            older ones are deleted once a newer one is committed.
        save_interval_steps: :meth:`save` writes only steps that are a multiple of
            this (``None``: every step it is called with).
        save_interval_seconds: :meth:`save` writes a step only if this many seconds
            passed since the last checkpoint (decided on process 0). With
            ``save_interval_steps`` too, either condition saves.
        async_save: :meth:`save` returns once the arrays are copied to host memory
            and writes them in a background thread; training goes on meanwhile.
            The checkpoint holds the values at the call either way. A pending save
            is finished at :meth:`close`, or at the latest when the interpreter
            exits (if it cannot be, the exit status is 1 and stderr says so).
            Default ``None``: asynchronous, except on CPython 3.12.0 to 3.12.2,
            which cannot finish a save at exit (there ``True`` raises).

    Raises:
        FleetCheckpointError: ``directory`` is a file, read-only or not writable;
            another live job (or another open manager of this process) writes it
            (the message names its host and pid); a bad option (``async_save=True``
            on CPython 3.12.0 to 3.12.2).

    Warns:
        FleetWarning: the directory's last writer ended without closing its
            manager (killed, ``os._exit``): its lock is taken over, and the step
            whose save it began and never finished is named.

    Example:
        >>> manager = fleet.CheckpointManager("ckpt", max_to_keep=3,  # doctest: +SKIP
        ...                                   save_interval_steps=100)
        >>> restored = manager.restore_latest(model=model, optimizer=opt, loader=loader)
        >>> start = 0 if restored is None else restored.step + 1
        >>> for step in range(start, steps):
        ...     loss = train_step(model, opt, *next(batches))
        ...     manager.save(step, model=model, optimizer=opt, loader=loader)
        >>> manager.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int | None = None,
        save_interval_seconds: int | None = None,
        async_save: bool | None = None,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = positive("max_to_keep", max_to_keep)
        self.save_interval_steps = positive("save_interval_steps", save_interval_steps)
        self.save_interval_seconds = positive("save_interval_seconds", save_interval_seconds)
        self.async_save = async_option(async_save)
        if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
            raise FleetCheckpointError(
                f"CheckpointManager: {self.directory} is a file, not a directory; a "
                "checkpoint manager writes one directory per step into a directory: "
                "give another path"
            )
        meet("__init__", repr(self))
        # One writer a directory (process 0 of the job holds the lock), before
        # orbax removes the partial steps it finds there (fleet/checkpoint/_open.py).
        self._lock = _open.open_directory(self.directory)
        if self._lock is not None:  # (dropped without close(): released at its end)
            weakref.finalize(self, self._lock.release)
        # fleet decides which steps to write and deletes old ones itself (only
        # once a newer step is committed), so orbax gets neither option.
        self._orbax = ocp.CheckpointManager(
            self.directory,
            handler_registry=_meta.registry(),
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
            ),
        )
        self._saving = PendingSave(self._orbax, self.directory, self._prune, self._lock)
        self._closed = False
        latest = self.latest_step()
        self._last_save = (None if latest is None else
                           os.path.getmtime(os.path.join(self.directory, str(latest))))

    # -- what is there, and what is written ----------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps saved completely, oldest first (half-written ones never count)."""
        return sorted(self._orbax.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        return self._orbax.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would write ``step`` now (same answer on every process;
        with ``save_interval_seconds`` a collective call)."""
        step = step_number(step)
        return step not in self.all_steps() and self._wants(step, force=False)

    def _wants(self, step: int, force: bool) -> bool:
        if force or (self.save_interval_steps is None and self.save_interval_seconds is None):
            return True
        if self.save_interval_steps is not None and step % self.save_interval_steps == 0:
            return True
        if self.save_interval_seconds is None:
            return False
        due = self._last_save is None or time.time() - self._last_save >= self.save_interval_seconds
        if jax.process_count() == 1:
            return due
        # (as process 0 decided, so that every process decides the same)
        return _agree.agree("fleet.CheckpointManager.save(interval)", str(int(due)))[0] == "1"

    def _prune(self) -> None:
        """Deletes the steps beyond ``max_to_keep`` (once a newer one is committed)."""
        if self.max_to_keep is not None:
            for step in self.all_steps()[:-self.max_to_keep]:
                self._orbax.delete(step)

    # -- save -----------------------------------------------------------------------

    @takes_contents
    def save(self, step: int, *, epoch: int | None = None,
             metadata: dict[str, Any] | None = None, force: bool = False,
             **objects: Any) -> bool:
        """Writes the training state as ``step``, if the save interval says so.

        Collective: every process calls it, with the same ``step``. With
        ``async_save``, a failure of the previous save is raised here.

        Args:
            step: the number of the step just taken.
            model, optimizer, state, rng, loader: what the checkpoint holds, each
                optional (:class:`fleet.checkpoint._state.Contents`): an NNX model
                (every variable, parameters, batch-norm statistics and RNG streams
                alike), an ``nnx.Optimizer`` (``fleet.DistributedOptimizer``), any
                pytree of arrays (a Linen ``TrainState``), a PRNG key or a pytree
                of keys, and a ``fleet.io.DataLoader`` or batch sampler (its
                position, so a restored job continues with the very next batch).
            epoch: the epoch number, given back by :meth:`restore`.
            metadata: JSON data (dicts, lists, str, numbers, bool, None).
            force: write even if the interval says no (e.g. the last step), and
                overwrite ``step`` if it is already saved (the old copy is deleted
                first: until the new one is committed, the step is not listed).

        Returns:
            Whether a checkpoint was written (or started, with ``async_save``).

        Raises:
            FleetCheckpointError: ``step`` is already saved (and not ``force``);
                a save failed ("disk full at DIR" when the disk is full; the
                steps saved before are intact and listed).
        """
        contents = Contents.of("save", objects)
        step = step_number(step)
        self._saving.raise_if_failed()
        if not self._wants(step, force):
            return False
        world()  # a clear error before orbax's if fleet.init was not called
        parts = contents.parts()
        stored = {name: p.to_save() for name, p in parts.items()}
        pieces = {name: _integrity.host_pieces(v) for name, v in stored.items()}
        meet("save", {"step": step, "force": bool(force)})
        meta = _meta.build(step, epoch, metadata, contents.loader, parts, pieces)
        self._saving.settle()
        self._overwrite(step, force)
        items = {name: ocp.args.PyTreeSave(stored[name]) for name, p in parts.items() if p.leaves}
        items[_meta.NAME] = _meta.MetaSave(meta)
        needed = sum(int(getattr(v, "nbytes", 0)) for part in stored.values()
                     for v in part.values())
        self._saving.start(step, ocp.args.Composite(**items), needed)
        self._last_save = time.time()
        if self.async_save:
            self._saving.hold(step)
        else:
            self._prune()
        return True

    def _overwrite(self, step: int, force: bool) -> None:
        """Deletes a saved ``step`` before it is written again (``force`` only)."""
        if step in self.all_steps():
            if not force:
                raise FleetCheckpointError(
                    f"step {step} is already saved in {self.directory}; pass force=True to "
                    "overwrite it, or save under another step number"
                )
            self._orbax.delete(step)

    # -- restore -------------------------------------------------------------------

    @takes_contents
    def restore_latest(self, **objects: Any) -> Restored | None:
        """:meth:`restore` of the newest intact step; ``None`` (nothing changed) if
        there is none.

        Collective. A damaged step (an array that does not match its checksum, a
        file missing or cut short) is moved aside to ``<step>.damaged`` with a
        :class:`fleet.FleetWarning` naming it, and the next older one is tried.

        Raises:
            FleetCheckpointError: every saved step is damaged (nothing changed), or
                the newest intact step does not fit ``objects``.
        """
        contents = Contents.of("restore_latest", objects)
        meet("restore_latest", None)
        self._saving.settle()
        self._orbax.reload()
        return _restore.latest(self._orbax, self.directory, contents)

    @takes_contents
    def restore(self, step: int, **objects: Any) -> Restored:
        """Reads ``step`` into the objects given; ``state`` and ``rng`` come back new.

        Collective. Only the parts asked for are read (``model=`` alone to
        evaluate); ``model``, ``optimizer`` and ``loader`` are set in place. Every
        part is checked first (keys, shapes, dtypes, PRNG implementations, the
        loader's dataset and batch size): if anything differs, the error lists
        every difference and nothing is changed. Every array read is verified
        against its checksum before anything is set.

        Returns:
            :class:`Restored`: step, epoch, metadata, and the new ``state`` / ``rng``.

        Raises:
            FleetCheckpointError: no such step, it does not fit, or it is damaged
                (the message names the arrays that do not match their checksums).
        """
        contents = Contents.of("restore", objects)
        step = step_number(step)
        meet("restore", step)
        self._saving.settle()
        steps = self.all_steps()
        if step not in steps:
            raise FleetCheckpointError(
                f"there is no complete checkpoint of step {step} in {self.directory}; "
                f"saved steps: {steps}"
            )
        return _restore.read(self._orbax, self.directory, step, contents)

    # -- lifetime --------------------------------------------------------------------

    def is_saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._orbax.is_saving_in_progress()

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save is written and committed. Collective.

        Raises:
            FleetCheckpointError: the save failed (see :meth:`save`).
        """
        meet("wait_until_finished", None)
        self._saving.settle()

    def close(self) -> None:
        """Finishes the pending save, releases the manager's threads and the
        directory's lock. Collective.

        Raises:
            FleetCheckpointError: the pending save failed (see :meth:`save`).
        """
        if self._closed:
            return
        meet("close", None)
        self._closed = True
        try:
            self._saving.settle()
        except BaseException:
            with contextlib.suppress(Exception):  # (the same failure, raised already)
                self._orbax.close()
            raise
        else:
            self._orbax.close()
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"save_interval_steps={self.save_interval_steps}, "
                f"save_interval_seconds={self.save_interval_seconds}, async_save={self.async_save})")
