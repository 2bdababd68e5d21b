"""``fleet.CheckpointManager``: whole training states, numbered by step, on orbax.

Layout: ``directory/<step>/`` holds one orbax item per part (``model``,
``optimizer``, ``state``, ``rng``: arrays in tensorstore's OCDBT format, each
shard written once, by the process that holds it) and ``meta`` (JSON: step,
epoch, loader position, user metadata, a CRC-32 of every array shard). No pickle
anywhere: loading reads arrays and JSON, it never runs code from the checkpoint.

Crash safety is orbax's commit protocol: a step is written under a temporary
name (``<step>.orbax-checkpoint-tmp-*``) and renamed to ``<step>`` only after
every process finished writing it, so a kill at any moment leaves the earlier
steps intact and a half-written step is never listed; the manager deletes such
leftovers when it starts. Older steps are deleted (``max_to_keep``) only once a
newer one is committed. A save that fails (disk full) raises at the latest on
the manager's next call, and its temporary directory is removed. "Disk full" is
decided by the error's ``errno`` or by the disk's free space after the failure
(:mod:`fleet.checkpoint._disk`), never by an error message's text. A pending
asynchronous save is finished when the interpreter exits; if it cannot be, the
exit status is 1 and stderr says which checkpoint was lost.

Integrity: every array is verified against its checksum after reading, before
anything is set in place. :meth:`CheckpointManager.restore_latest` moves a
damaged step aside (``<step>.damaged``), warns, and restores the newest intact one.

Collective calls (the constructor, ``save`` when it writes, ``restore``,
``restore_latest``, ``wait_until_finished``, ``close``) first meet the other
processes through :func:`fleet._agree.agree`: a process that does not make the
call ends them within ``FLEET_AGREE_TIMEOUT`` seconds (60) with an error naming
the call and the missing ranks, instead of a hang in orbax's barriers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fleet import _agree, _compat
from fleet._errors import FleetError, FleetWarning
from fleet._world import world
from fleet.checkpoint import _disk, _integrity, _state, _tree
from fleet.checkpoint._errors import FleetCheckpointError

_META = "meta"
_META_FILE = "metadata"  # (JsonCheckpointHandler's file name, which restore reads)

# Replicated arrays are written from replica 0 alone (process 0's first device),
# the copy ``state_dict()`` and ``fleet.save`` read. Orbax's default on CPU,
# replica-parallel writing, takes a different slice from each replica: the same
# bytes only if every replica holds the same values, which fleet's convention
# (process 0's first copy is the value) does not need to assume.
# Host values (numpy, numbers, process-local arrays) are numpy arrays, which orbax
# writes from process 0.
_REGISTRY = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
    (np.ndarray, ocp.type_handlers.NumpyHandler()),
)
_FORMAT = "fleet-checkpoint"
_VERSION = 1


_SUMMER = ThreadPoolExecutor(1, thread_name_prefix="fleet-checksums")


def _sum_and_share(pieces: dict[str, list]) -> dict[str, _integrity.Sums]:
    """The checksum tables of a step's parts: this process's shards, merged with
    every other process's (in the order of the saves: one summing thread)."""
    sums = {name: _integrity.sum_pieces(p) for name, p in pieces.items()}
    if jax.process_count() > 1:
        got = _agree.agree("fleet.CheckpointManager.save(checksums)", json.dumps(sums))
        sums = {name: _integrity.merge([json.loads(g)[name] for g in got]) for name in sums}
    return sums


class _MetaHandler(ocp.JsonCheckpointHandler):
    """Writes a step's JSON (``meta/metadata``, on process 0) once its checksums
    (a future) are summed, in orbax's commit thread: the save returns at once.

    It replaces only the public ``async_save`` (``save`` calls it) and returns the
    kind of commit future ``JsonCheckpointHandler`` returns
    (``ocp.future.CommitFutureAwaitingContractedSignals``: it waits for orbax's
    signal that the item's directory exists before writing)."""

    async def async_save(self, directory, item=None, args=None):
        x = args.item if args is not None else item

        async def write() -> None:
            value = x
            if isinstance(value.get("checksums"), Future):
                value = dict(value, checksums=await asyncio.wrap_future(value["checksums"]))
            if jax.process_index() == 0:
                (directory / _META_FILE).write_text(json.dumps(value))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="fleet_meta_save")]


@ocp.args.register_with_handler(_MetaHandler, for_save=True)
@dataclasses.dataclass
class _MetaSave(ocp.args.JsonSave):
    """A step's JSON (``meta``), written by :class:`_MetaHandler`."""


@ocp.args.register_with_handler(_MetaHandler, for_restore=True)
@dataclasses.dataclass
class _MetaRestore(ocp.args.JsonRestore):
    """Reads a step's JSON (``meta``)."""


class _Damaged(FleetCheckpointError):
    """A step that cannot be read as it was written (``restore_latest`` skips it)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.restore` read besides the objects it set in place.

    Attributes:
        step: the step of the checkpoint (continue with ``step + 1``).
        epoch: the ``epoch`` given to ``save`` (``None`` if none was).
        metadata: the ``metadata`` given to ``save`` (``{}`` if none was).
        state: the restored ``state`` pytree (``None`` if not asked for).
        rng: the restored ``rng`` key(s) (``None`` if not asked for).
    """

    step: int
    epoch: int | None
    metadata: dict[str, Any]
    state: Any = None
    rng: Any = None


def _positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise FleetCheckpointError(f"{name} must be an int >= 1 or None, got {value!r}")
    return int(value)


def _step_number(step: Any) -> int:
    if isinstance(step, jax.Array) and step.ndim == 0:
        step = int(np.asarray(step.addressable_shards[0].data))
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise FleetCheckpointError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


# --------------------------------------------------------------------------- interpreter exit

# Managers with a save in flight, held (strongly) until it is settled: a manager
# the script dropped still finishes its save at exit.
_PENDING: set = set()
_HOOKED: list[bool] = []


def _finish_pending_saves() -> None:
    """Runs when the main thread ends (before ``concurrent.futures`` stops taking
    work, which would kill orbax's background save): finishes every pending save."""
    for manager in list(_PENDING):
        manager._finish_at_exit()


def _hook_exit() -> None:
    if not _HOOKED:
        _compat.register_before_exit(_finish_pending_saves)  # before atexit's hooks
        _HOOKED.append(True)


class CheckpointManager:
    """Saves and restores whole training states; keeps the last ``max_to_keep``.

    Collective: every process of the job must create the manager and call
    :meth:`save`, :meth:`restore`, :meth:`restore_latest`,
    :meth:`wait_until_finished` and :meth:`close` with the same arguments (never
    under ``if fleet.is_first_worker():``). Each of these first meets the other
    processes and waits at most ``FLEET_AGREE_TIMEOUT`` seconds (60): a process
    that does not make the call ends the others with a
    :class:`fleet._agree.FleetTimeoutError` naming the call and its rank. All
    processes must see ``directory``: one machine's disk, or a shared file system.

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

    Raises:
        FleetCheckpointError: ``directory`` is a file, or a bad option.

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
        async_save: bool = True,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = _positive("max_to_keep", max_to_keep)
        self.save_interval_steps = _positive("save_interval_steps", save_interval_steps)
        self.save_interval_seconds = _positive("save_interval_seconds", save_interval_seconds)
        self.async_save = bool(async_save)
        if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
            raise FleetCheckpointError(
                f"CheckpointManager: {self.directory} is a file, not a directory; a "
                "checkpoint manager writes one directory per step into a directory: "
                "give another path"
            )
        self._meet("__init__", repr(self))
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for name in _state.ARRAY_PARTS:
            handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_REGISTRY)
            registry.add(name, ocp.args.PyTreeSave, handler)
            registry.add(name, ocp.args.PyTreeRestore, handler)
        meta = _MetaHandler()
        registry.add(_META, _MetaSave, meta)
        registry.add(_META, _MetaRestore, meta)
        # fleet decides which steps to write and deletes old ones itself (only
        # once a newer step is committed), so orbax gets neither option.
        self._orbax = ocp.CheckpointManager(
            self.directory,
            handler_registry=registry,
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
            ),
        )
        self._pending: int | None = None  # the step an asynchronous save is writing
        self._needed = 0  # its size in bytes (a failed save: was the disk full?)
        self._closed = False
        latest = self.latest_step()
        self._last_save = (None if latest is None else
                           os.path.getmtime(os.path.join(self.directory, str(latest))))
        _hook_exit()

    # -- meeting the other processes -----------------------------------------------------

    def _meet(self, call: str, value: Any) -> None:
        """Every process makes ``call`` with the same ``value`` (a bounded wait)."""
        if jax.process_count() == 1:
            return
        name = f"fleet.CheckpointManager.{call}" if call != "__init__" else "fleet.CheckpointManager()"
        got = _agree.agree(name, json.dumps(value))
        if any(g != got[0] for g in got):
            raise FleetCheckpointError(
                f"{name}: the processes made this call with different arguments ("
                + "; ".join(f"rank {r}: {g}" for r, g in enumerate(got))
                + "); every process must make the same calls"
            )

    # -- what is there ------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps saved completely, oldest first (half-written ones never count)."""
        return sorted(self._orbax.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        return self._orbax.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would write ``step`` now (same answer on every process;
        with ``save_interval_seconds`` a collective call)."""
        step = _step_number(step)
        return step not in self.all_steps() and self._wants(step, force=False)

    def _wants(self, step: int, force: bool) -> bool:
        if force or (self.save_interval_steps is None and self.save_interval_seconds is None):
            return True
        if self.save_interval_steps is not None and step % self.save_interval_steps == 0:
            return True
        if self.save_interval_seconds is None:
            return False
        due = self._last_save is None or time.time() - self._last_save >= self.save_interval_seconds
        if jax.process_count() > 1:  # decided on process 0, so every process saves the same steps
            due = _agree.agree("fleet.CheckpointManager.save(interval)", str(int(due)))[0] == "1"
        return due

    # -- save -----------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        model: Any = None,
        optimizer: Any = None,
        loader: Any = None,
        rng: Any = None,
        state: Any = None,
        epoch: int | None = None,
        metadata: dict[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Writes the training state as ``step``, if the save interval says so.

        Collective: every process calls it, with the same ``step``. With
        ``async_save``, a failure of the previous save is raised here.

        Args:
            step: the number of the step just taken.
            model: an NNX model (``fleet.DataParallel`` or plain): every variable,
                parameters, batch-norm statistics and RNG streams alike.
            optimizer: an ``nnx.Optimizer`` (``fleet.DistributedOptimizer``).
            loader: a ``fleet.io.DataLoader`` or batch sampler; its position, so a
                restored job continues with the very next batch.
            rng: a PRNG key or a pytree of keys the script carries.
            state: any pytree of arrays (a Linen ``TrainState``).
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
        step = _step_number(step)
        self._raise_if_failed()
        if not self._wants(step, force):
            return False
        world()  # a clear error before orbax's if fleet.init was not called
        parts = _state.parts(model=model, optimizer=optimizer, state=state, rng=rng)
        stored = {name: p.to_save() for name, p in parts.items()}
        pieces = {name: _integrity.host_pieces(v) for name, v in stored.items()}
        self._meet("save", {"step": step, "force": bool(force)})
        meta = {
            "format": _FORMAT,
            "version": _VERSION,
            "step": step,
            "epoch": _state.jsonable(epoch, "epoch"),
            "metadata": _state.jsonable(metadata or {}, "metadata"),
            "loader": None if loader is None else _state.loader_state(loader),
            "parts": sorted(parts),
            "key_impls": {name: p.impls() for name, p in parts.items()},
            "processes": jax.process_count(),
            "replicas": world().num_replicas,
            # Summed in the background while orbax writes the arrays; the JSON is
            # written once they are ready (_MetaHandler).
            "checksums": _SUMMER.submit(_sum_and_share, pieces),
            "checksum": _integrity.ALGORITHM,
        }
        self._settle()
        if step in self.all_steps():
            if not force:
                raise FleetCheckpointError(
                    f"step {step} is already saved in {self.directory}; pass force=True to "
                    "overwrite it, or save under another step number"
                )
            self._orbax.delete(step)
        items = {name: ocp.args.PyTreeSave(stored[name]) for name, p in parts.items() if p.leaves}
        items[_META] = _MetaSave(meta)
        self._needed = sum(int(getattr(v, "nbytes", 0)) for part in stored.values()
                           for v in part.values())
        try:
            self._orbax.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 (tensorstore's and orbax's own errors)
            self._failed(step, e)
        self._last_save = time.time()
        if self.async_save:
            self._pending = step
            _PENDING.add(self)
        else:
            self._prune()
        return True

    def _raise_if_failed(self) -> None:
        """Raises now if the pending asynchronous save ended with an error (no wait)."""
        if self._pending is not None and not self._orbax.is_saving_in_progress():
            self._settle(prune=False)

    def _settle(self, prune: bool = True) -> None:
        """Waits for the pending save: raises if it failed, else deletes old steps."""
        step, self._pending = self._pending, None
        _PENDING.discard(self)
        if step is not None:
            try:
                self._orbax.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                self._failed(step, e)
        if prune:
            self._prune()

    def _failed(self, step: int, e: BaseException) -> None:
        """A save of ``step`` failed: removes what it left, raises a clear error."""
        self._remove_leftovers(step)
        self._orbax.reload()
        kept = f"the steps saved before are intact: {self.all_steps()}"
        if _disk.is_full(e, self.directory, self._needed):
            raise FleetCheckpointError(
                f"disk full at {self.directory}: the checkpoint of step {step} was not "
                f"written (its temporary files are removed; {kept}); free space, or "
                f"lower max_to_keep, and save again ({_disk.describe(self.directory, self._needed)})"
            ) from None
        raise FleetCheckpointError(
            f"the checkpoint of step {step} in {self.directory} was not written "
            f"({_first_line(e)}); its temporary files are removed; {kept}"
        ) from e

    def _remove_leftovers(self, step: int) -> None:
        """Removes the temporary directories of a failed save of ``step`` (process 0)."""
        if jax.process_index() == 0:
            for leftover in glob.glob(os.path.join(glob.escape(self.directory),
                                                   f"{step}.orbax-checkpoint-tmp*")):
                shutil.rmtree(leftover, ignore_errors=True)

    def _prune(self) -> None:
        if self.max_to_keep is not None:
            for step in self.all_steps()[:-self.max_to_keep]:
                self._orbax.delete(step)

    # -- restore -------------------------------------------------------------------

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
        self._meet("restore_latest", None)
        self._settle()
        self._orbax.reload()
        steps = self.all_steps()
        damaged = []
        for step in reversed(steps):
            try:
                return self._restore(step, **objects)
            except _Damaged as e:
                moved = self._set_aside(step)
                damaged.append(step)
                warnings.warn(f"{e}; skipped it (moved to {moved}) and trying the step before",
                              FleetWarning, stacklevel=2)
        if damaged:
            raise FleetCheckpointError(
                f"every checkpoint in {self.directory} is damaged (steps {damaged}, moved to "
                "<step>.damaged); nothing was restored"
            )
        return None

    def _set_aside(self, step: int) -> str:
        """Renames the damaged ``step`` so it is no longer listed (nor overwritten)."""
        target = ""
        if jax.process_index() == 0:
            source = os.path.join(self.directory, str(step))
            target, n = f"{source}.damaged", 1
            while os.path.lexists(target):
                n += 1
                target = f"{source}.damaged-{n}"
            os.rename(source, target)
        if jax.process_count() > 1:  # (the others wait for the rename, and name it alike)
            target = _agree.agree("fleet.CheckpointManager.restore_latest(set aside)", target)[0]
        self._orbax.reload()
        return target

    def restore(
        self,
        step: int,
        *,
        model: Any = None,
        optimizer: Any = None,
        loader: Any = None,
        rng: Any = None,
        state: Any = None,
    ) -> Restored:
        """Reads ``step`` into the objects given; ``state`` and ``rng`` come back new.

        Collective. Only the parts asked for are read (``model=`` alone to
        evaluate). Every part is checked first (keys, shapes, dtypes, PRNG
        implementations, the loader's dataset and batch size): if anything
        differs, the error lists every difference and nothing is changed. Every
        array read is verified against its checksum before anything is set.

        Returns:
            :class:`Restored`: step, epoch, metadata, and the new ``state`` / ``rng``.

        Raises:
            FleetCheckpointError: no such step, it does not fit, or it is damaged
                (the message names the arrays that do not match their checksums).
        """
        step = _step_number(step)
        self._meet("restore", step)
        self._settle()
        steps = self.all_steps()
        if step not in steps:
            raise FleetCheckpointError(
                f"there is no complete checkpoint of step {step} in {self.directory}; "
                f"saved steps: {steps}"
            )
        return self._restore(step, model=model, optimizer=optimizer, loader=loader, rng=rng,
                             state=state)

    def _restore(self, step: int, *, model: Any = None, optimizer: Any = None,
                 loader: Any = None, rng: Any = None, state: Any = None) -> Restored:
        world()  # a clear error before orbax's if fleet.init was not called
        parts = _state.parts(model=model, optimizer=optimizer, state=state, rng=rng)
        meta = self._read_meta(step)
        problems = self._problems(step, meta, parts)
        if loader is not None:
            problems += _state.loader_problems(loader, meta.get("loader"))
        if problems:
            raise FleetCheckpointError(
                f"checkpoint {self.directory}/{step} does not fit what it is restored into "
                f"({len(problems)} difference{'s' if len(problems) > 1 else ''}; nothing was "
                "changed):\n  " + "\n  ".join(problems)
            )
        args = {}
        for name, part in parts.items():
            if part.leaves:  # (an empty part has no orbax item)
                items, restore_args = part.targets()
                args[name] = ocp.args.PyTreeRestore(items, restore_args=restore_args)
        values, verdict = {}, ""
        try:
            values = self._orbax.restore(step, args=ocp.args.Composite(**args)) if args else {}
            sums = meta.get("checksums") or {}
            bad = [f"{name} {b}" for name in args
                   for b in _integrity.mismatches(sums.get(name, {}), dict(values[name]))]
            if bad:
                many = len(bad) > 1
                verdict = (f"{len(bad)} array{'s do' if many else ' does'} not match the checksum "
                           f"written with {'them' if many else 'it'}:\n  " + "\n  ".join(bad))
        except FleetError:
            raise
        except Exception as e:  # noqa: BLE001 (tensorstore's errors on damaged files)
            verdict = f"it cannot be read ({_first_line(e)})"
        if jax.process_count() > 1:  # damaged for one process means damaged for all
            verdicts = _agree.agree("fleet.CheckpointManager.restore(verify)", verdict)
            verdict = next((f"{v} (found by rank {r})" for r, v in enumerate(verdicts) if v), "")
        if verdict:
            raise _Damaged(f"checkpoint {self.directory}/{step} is damaged: {verdict}")
        new = {name: p.put(values[name] if p.leaves else {}) for name, p in parts.items()}
        if loader is not None:
            loader.set_state_dict(meta["loader"])
        return Restored(step=step, epoch=meta.get("epoch"), metadata=meta.get("metadata") or {},
                        state=new.get("state"), rng=new.get("rng"))

    def _read_meta(self, step: int) -> dict[str, Any]:
        try:
            meta = self._orbax.restore(step, args=ocp.args.Composite(
                **{_META: _MetaRestore()}))[_META]
        except Exception as e:  # noqa: BLE001 (JSON that does not parse, a missing file)
            raise _Damaged(
                f"checkpoint {self.directory}/{step} is damaged: its {_META!r} item is not "
                f"readable JSON ({_first_line(e)}); restore another step"
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise FleetCheckpointError(
                f"{self.directory}/{step} is not a fleet checkpoint (its {_META!r} item "
                f"is {type(meta).__name__}); write checkpoints with fleet.CheckpointManager"
            )
        if meta.get("version", 0) > _VERSION:
            raise FleetCheckpointError(
                f"{self.directory}/{step} was written by a newer fleet (checkpoint version "
                f"{meta['version']}, this fleet reads up to {_VERSION}); upgrade fleet"
            )
        return meta

    def _problems(self, step: int, meta: dict, parts: dict[str, _state.Part]) -> list[str]:
        try:
            items = self._orbax.metadata(step).item_metadata
        except Exception as e:  # noqa: BLE001 (a deleted or cut-short metadata file)
            raise _Damaged(f"checkpoint {self.directory}/{step} is damaged: its metadata "
                           f"cannot be read ({_first_line(e)})") from None
        problems = []
        for name, part in parts.items():
            if name not in meta["parts"]:
                problems.append(
                    f"{name}: not in the checkpoint (it holds {', '.join(meta['parts']) or 'no arrays'})"
                )
                continue
            item = items[name] if name in items else None
            tree = {} if item is None else getattr(item, "tree", item)
            if part.leaves and not tree:
                raise _Damaged(f"checkpoint {self.directory}/{step} is damaged: the metadata "
                               f"of its {name!r} item is missing")
            saved = {k: (tuple(m.shape), np.dtype(m.dtype).name) for k, m in tree.items()}
            if _grows_accumulator(part, saved):
                part = parts[name] = _state.Part.of(name, part.obj)
            problems += [f"{name}: {p}" for p in _tree.differences(
                saved, part.signatures(), meta["key_impls"].get(name, {}), part.impls())]
        return problems

    # -- lifetime --------------------------------------------------------------------

    def is_saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._orbax.is_saving_in_progress()

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save is written and committed. Collective.

        Raises:
            FleetCheckpointError: the save failed (see :meth:`save`).
        """
        self._meet("wait_until_finished", None)
        self._settle()

    def close(self) -> None:
        """Finishes the pending save and releases the manager's threads. Collective.

        Raises:
            FleetCheckpointError: the pending save failed (see :meth:`save`).
        """
        if self._closed:
            return
        self._meet("close", None)
        try:
            self._settle()
        except BaseException:
            self._closed = True
            try:
                self._orbax.close()
            except Exception:  # noqa: BLE001 (the same failure, raised already)
                pass
            raise
        self._closed = True
        self._orbax.close()

    def _finish_at_exit(self) -> None:
        """At interpreter exit: finishes the pending save, or says it is lost (exit status 1)."""
        if self._closed or self._pending is None:
            return
        step = self._pending
        try:
            self._orbax.wait_until_finished()
            self._pending = None
            _PENDING.discard(self)
            if jax.process_count() == 1:
                self._prune()
        except BaseException as e:  # noqa: BLE001
            self._closed = True
            self._remove_leftovers(step)
            why = "disk full" if _disk.is_full(e, self.directory, self._needed) else _first_line(e)
            sys.stdout.flush()
            print(f"fleet.CheckpointManager: the checkpoint of step {step} in {self.directory} "
                  f"was LOST at interpreter exit ({why}); "
                  f"the steps saved before are intact. Exiting with status 1.",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"save_interval_steps={self.save_interval_steps}, "
                f"save_interval_seconds={self.save_interval_seconds}, async_save={self.async_save})")


def _grows_accumulator(part: _state.Part, saved: dict) -> bool:
    """A checkpoint taken between ``no_sync`` steps holds the distributed optimizer's
    ``grad_accum``; a freshly built optimizer gets one (zeros) before the restore
    fills it. Returns whether the object changed."""
    ensure = getattr(part.obj, "ensure_accumulator", None)
    prefix = "grad_accum."
    extra = {k: v for k, v in saved.items() if k.startswith(prefix) and k not in part.leaves}
    if ensure is None or not extra:
        return False
    return ensure({k[len(prefix):].replace(":", "."): (shape[1:], np.dtype(dtype))
                   for k, (shape, dtype) in extra.items()})
