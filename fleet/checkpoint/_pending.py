"""A manager's save in flight: its failure raised at the next call, old steps
deleted once it is committed, and at interpreter exit finished (or said lost).

With ``async_save``, ``CheckpointManager.save`` returns while orbax writes the
step in a background thread; :class:`PendingSave` holds that step until it is
settled: at the manager's next collective call, at ``close``, or when the
interpreter exits. A save that fails removes its temporary directories
(``<step>.orbax-checkpoint-tmp-*``) and raises a :class:`FleetCheckpointError`
that says whether the disk was full (:mod:`fleet.checkpoint._disk`) and lists
the steps saved before, which are intact.

Interpreter exit: a script may end (return, raise) without ``close()``, or drop
its manager, while a save is being written. A pending save is held here
(strongly) until it is settled, and finished when the main thread ends: the
hook is registered with :func:`fleet._compat.register_before_exit`, which runs
before ``concurrent.futures`` stops taking work (that would kill orbax's
background save) and before ``atexit``'s hooks. If the save cannot be finished,
stderr says which checkpoint was lost and the process exits with status 1.

Where a thread cannot start at exit (CPython 3.12.0 to 3.12.2, gh-113964; orbax
finishes a save in new threads, ``asyncio.to_thread``), saves are synchronous
(:func:`async_option`).

Where nothing can finish the save (``kill -9``; ``os._exit``, which skips every
exit hook), the step a save began is recorded in the directory's lock file
before ``save`` returns (:mod:`fleet.checkpoint._lock`), and the next manager on
the directory says that the step was never finished (:mod:`fleet.checkpoint._open`).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp

from fleet import _compat
from fleet.checkpoint import _disk
from fleet.checkpoint._errors import FleetCheckpointError, first_line
from fleet.checkpoint._lock import DirectoryLock

#: orbax's name of a step being written: ``<step>.orbax-checkpoint-tmp-<time>``.
PARTIAL = ".orbax-checkpoint-tmp"

#: Whether a save still pending when the interpreter exits can be finished then:
#: not on CPython 3.12.0 to 3.12.2, which start no thread once exit has begun.
FINISHES_AT_EXIT = not (sys.implementation.name == "cpython"
                        and (3, 12) <= sys.version_info[:3] < (3, 12, 3))


def async_option(async_save: bool | None) -> bool:
    """``CheckpointManager(async_save=...)``: ``None`` is asynchronous where a save
    pending at exit can be finished (:data:`FINISHES_AT_EXIT`), else synchronous;
    ``True`` where it cannot raises."""
    if async_save is None:
        return FINISHES_AT_EXIT
    if async_save and not FINISHES_AT_EXIT:
        version = ".".join(map(str, sys.version_info[:3]))
        raise FleetCheckpointError(
            f"CheckpointManager(async_save=True) on Python {version}: CPython 3.12.0 to 3.12.2 "
            "start no thread once the interpreter exits, so a save still being written then "
            "would be lost; use Python 3.12.3 or later (or 3.11, 3.13), or leave async_save "
            "out (saves are synchronous on this Python)")
    return bool(async_save)


# Saves in flight, held until they are settled: a manager the script dropped
# still finishes its save at exit.
_IN_FLIGHT: set[PendingSave] = set()
_HOOKED: list[bool] = []


def _finish_all() -> None:
    """Runs when the main thread ends: finishes every save in flight."""
    for pending in list(_IN_FLIGHT):
        pending.finish_at_exit()


def remove_partial(directory: str, step: int) -> None:
    """Removes what an unfinished save of ``step`` left in ``directory`` (its
    temporary directories; call on process 0)."""
    for leftover in glob.glob(os.path.join(glob.escape(directory), f"{step}{PARTIAL}*")):
        shutil.rmtree(leftover, ignore_errors=True)


def _hook_exit() -> None:
    if not _HOOKED:
        _compat.register_before_exit(_finish_all)  # before atexit's hooks
        _HOOKED.append(True)


#: How often a failed save's errors are waited out (``PendingSave._clean_up``): orbax's
#: save thread, then its metadata writer.
_DRAIN_WAITS = 3

class PendingSave:
    """The save of one manager's ``orbax`` (writing into ``directory``) that is not
    settled yet, if any; ``prune`` deletes the steps beyond ``max_to_keep`` (called
    once a save is committed)."""

    def __init__(self, orbax: ocp.CheckpointManager, directory: str,
                 prune: Callable[[], None], lock: DirectoryLock | None = None):
        self.orbax = orbax
        self.directory = directory
        self.prune = prune
        self.lock = lock  # (process 0's: it records the step being saved)
        self.step: int | None = None  # the step an asynchronous save is writing
        self.needed = 0  # its size in bytes (a failed save: was the disk full?)
        _hook_exit()

    def start(self, step: int, args: ocp.args.Composite, needed: int) -> None:
        """Starts orbax's save of ``step`` (``needed`` bytes of arrays); raises at once
        if orbax does."""
        self.needed = needed
        if self.lock is not None:  # (a writer that ends before the commit: said next time)
            self.lock.saving(step)
        try:
            self.orbax.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 (tensorstore's and orbax's own errors)
            self.failed(step, e)

    def hold(self, step: int) -> None:
        """``step`` is being written asynchronously: settled later, or at exit."""
        self.step = step
        _IN_FLIGHT.add(self)

    def raise_if_failed(self) -> None:
        """Raises now if the pending save ended with an error (no wait)."""
        if self.step is not None and not self.orbax.is_saving_in_progress():
            self.settle(prune=False)

    def settle(self, prune: bool = True) -> None:
        """Waits for the pending save: raises if it failed, else (``prune``)
        deletes old steps."""
        step, self.step = self.step, None
        _IN_FLIGHT.discard(self)
        if step is not None:
            try:
                self.orbax.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                self.failed(step, e)
        if prune:
            self.prune()

    def failed(self, step: int, e: BaseException) -> None:
        """A save of ``step`` failed: removes what it left, raises a clear error."""
        self._clean_up(step)
        self.orbax.reload()
        kept = f"the steps saved before are intact: {sorted(self.orbax.all_steps())}"
        if _disk.is_full(e, self.directory, self.needed):
            raise FleetCheckpointError(
                f"disk full at {self.directory}: the checkpoint of step {step} was not "
                f"written (its temporary files are removed; {kept}); free space, or "
                f"lower max_to_keep, and save again ({_disk.describe(self.directory, self.needed)})"
            ) from None
        raise FleetCheckpointError(
            f"the checkpoint of step {step} in {self.directory} was not written "
            f"({first_line(e)}); its temporary files are removed; {kept}"
        ) from e

    def _clean_up(self, step: int) -> None:
        """Removes what a failed save of ``step`` left (its temporary directories, on
        process 0) once nothing of it still runs in orbax's threads. orbax
        raises a background save's error once and then skips the wait for its
        checkpoint-metadata writer, which may still be writing into the save's
        temporary directory: removed under it, that write fails in turn, and its
        error would surface in the next read (a good step then looked damaged).
        Each further wait raises the next error of the same failed save, or returns."""
        for _ in range(_DRAIN_WAITS):
            try:
                self.orbax.wait_until_finished()
                break
            except Exception:  # noqa: BLE001 (the failed save's own errors: reported once)
                continue
        if jax.process_index() == 0:
            remove_partial(self.directory, step)

    def finish_at_exit(self) -> None:
        """At interpreter exit: finishes the pending save, or says it is lost (exit status 1)."""
        if self.step is None:
            return
        step = self.step
        try:
            self.orbax.wait_until_finished()
            self.step = None
            _IN_FLIGHT.discard(self)
            if jax.process_count() == 1:
                self.prune()
        except BaseException as e:  # noqa: BLE001
            self._clean_up(step)
            why = "disk full" if _disk.is_full(e, self.directory, self.needed) else first_line(e)
            sys.stdout.flush()
            print(f"fleet.CheckpointManager: the checkpoint of step {step} in {self.directory} "
                  f"was LOST at interpreter exit ({why}); "
                  f"the steps saved before are intact. Exiting with status 1.",
                  file=sys.stderr, flush=True)
            if self.lock is not None:  # (said here: the next manager finds a clean directory)
                self.lock.release()
            os._exit(1)
