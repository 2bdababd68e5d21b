"""``fleet.CheckpointManager``: whole training states, numbered by step, on orbax.

Layout: ``directory/<step>/`` holds one orbax item per part (``model``,
``optimizer``, ``state``, ``rng``: arrays in tensorstore's OCDBT format, each
shard written once, by the process that holds it) and ``meta`` (JSON: step,
epoch, loader position, user metadata). No pickle anywhere: loading reads arrays
and JSON, it never runs code from the checkpoint.

Crash safety is orbax's commit protocol: a step is written under a temporary
name (``<step>.orbax-checkpoint-tmp-*``) and renamed to ``<step>`` only after
every process finished writing it, so a kill at any moment leaves the earlier
steps intact and a half-written step is never listed; the manager deletes such
leftovers when it starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from fleet._world import world
from fleet.checkpoint import _state, _tree
from fleet.checkpoint._errors import FleetCheckpointError

_META = "meta"

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


def _save_policy(every_steps: int | None, every_seconds: int | None):
    chosen = []
    if every_steps is not None:
        chosen.append(policies.FixedIntervalPolicy(every_steps))
    if every_seconds is not None:
        # Decided on process 0 and shared, so every process saves the same steps.
        chosen.append(policies.ContinuousCheckpointingPolicy(minimum_interval_secs=every_seconds))
    return policies.AnySavePolicy(chosen or [policies.FixedIntervalPolicy(1)])


class CheckpointManager:
    """Saves and restores whole training states; keeps the last ``max_to_keep``.

    Every process of the job calls every method with the same arguments (save and
    restore are collective). All processes must see ``directory``: one machine's
    disk, or a file system shared by the machines.

    Args:
        directory: where the steps are written (created if missing).
        max_to_keep: keep only the newest ``max_to_keep`` steps (``None``: all).
        save_interval_steps: :meth:`save` writes only steps that are a multiple of
            this (``None``: every step it is called with).
        save_interval_seconds: :meth:`save` writes a step only if this many seconds
            passed since the last checkpoint (decided on process 0). With
            ``save_interval_steps`` too, either condition saves.
        async_save: :meth:`save` returns once the arrays are copied to host memory
            and writes them in a background thread; training goes on meanwhile.
            The checkpoint holds the values at the call either way. Call
            :meth:`close` (or use ``with``) before the script ends.

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
        handlers = {name: ocp.PyTreeCheckpointHandler(type_handler_registry=_REGISTRY)
                    for name in _state.ARRAY_PARTS}
        handlers[_META] = ocp.JsonCheckpointHandler()
        self._orbax = ocp.CheckpointManager(
            self.directory,
            item_handlers=handlers,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
                save_decision_policy=_save_policy(
                    self.save_interval_steps, self.save_interval_seconds
                ),
            ),
        )

    # -- what is there ------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps saved completely, oldest first (half-written ones never count)."""
        return sorted(self._orbax.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        return self._orbax.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would write ``step`` now (same answer on every process)."""
        step = _step_number(step)
        return step not in self._orbax.all_steps() and self._orbax.should_save(step)

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
            force: write even if the interval says no (e.g. the last step).

        Returns:
            Whether a checkpoint was written (or started, with ``async_save``).
        """
        step = _step_number(step)
        if step in self._orbax.all_steps():
            return False
        if not force and not self._orbax.should_save(step):
            return False
        world()  # a clear error before orbax's if fleet.init was not called
        parts = _state.parts(model=model, optimizer=optimizer, state=state, rng=rng)
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
        }
        items = {name: ocp.args.PyTreeSave(p.to_save()) for name, p in parts.items() if p.leaves}
        items[_META] = ocp.args.JsonSave(meta)
        self._orbax.save(step, args=ocp.args.Composite(**items), force=True)
        return True

    # -- restore -------------------------------------------------------------------

    def restore_latest(self, **objects: Any) -> Restored | None:
        """:meth:`restore` of the newest step; ``None`` (nothing changed) if there is none."""
        self._orbax.wait_until_finished()
        self._orbax.reload()
        step = self.latest_step()
        return None if step is None else self.restore(step, **objects)

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

        Only the parts asked for are read (``model=`` alone to evaluate). Every
        part is checked first (keys, shapes, dtypes, PRNG implementations, the
        loader's dataset and batch size): if anything differs, the error lists
        every difference and nothing is changed.

        Returns:
            :class:`Restored`: step, epoch, metadata, and the new ``state`` / ``rng``.
        """
        step = _step_number(step)
        self._orbax.wait_until_finished()
        steps = self.all_steps()
        if step not in steps:
            raise FleetCheckpointError(
                f"there is no complete checkpoint of step {step} in {self.directory}; "
                f"saved steps: {steps}"
            )
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
        values = self._orbax.restore(step, args=ocp.args.Composite(**args)) if args else {}
        new = {name: p.put(values[name] if p.leaves else {}) for name, p in parts.items()}
        if loader is not None:
            loader.set_state_dict(meta["loader"])
        return Restored(step=step, epoch=meta.get("epoch"), metadata=meta.get("metadata") or {},
                        state=new.get("state"), rng=new.get("rng"))

    def _read_meta(self, step: int) -> dict[str, Any]:
        try:
            meta = self._orbax.restore(step, args=ocp.args.Composite(
                **{_META: ocp.args.JsonRestore()}))[_META]
        except (ValueError, OSError) as e:  # JSON that does not parse, a missing file
            raise FleetCheckpointError(
                f"{self.directory}/{step}: its {_META!r} item is not readable JSON ({e!r}); "
                "the checkpoint is damaged, restore another step"
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
        items = self._orbax.metadata(step).item_metadata
        problems = []
        for name, part in parts.items():
            if name not in meta["parts"]:
                problems.append(
                    f"{name}: not in the checkpoint (it holds {', '.join(meta['parts']) or 'no arrays'})"
                )
                continue
            item = items[name] if name in items else None
            tree = {} if item is None else getattr(item, "tree", item)
            saved = {k: (tuple(m.shape), np.dtype(m.dtype).name) for k, m in tree.items()}
            problems += [f"{name}: {p}" for p in _tree.differences(
                saved, part.signatures(), meta["key_impls"].get(name, {}), part.impls())]
        return problems

    # -- lifetime --------------------------------------------------------------------

    def is_saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._orbax.is_saving_in_progress()

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save is written and committed."""
        self._orbax.wait_until_finished()

    def close(self) -> None:
        """Finishes the pending save and releases the manager's threads."""
        self._orbax.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"save_interval_steps={self.save_interval_steps}, "
                f"save_interval_seconds={self.save_interval_seconds}, async_save={self.async_save})")

