"""Restoring a step into live objects (:func:`read`: checked, then read and
verified on every process, then set; nothing changes when anything differs),
and falling back from a damaged step to the newest intact one (:func:`latest`).
Every read runs inside :func:`fleet.checkpoint._settle.collect`, so that a
damaged array leaves none of orbax's reads running when the error is raised.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fleet._errors import FleetError, FleetWarning
from fleet.checkpoint import _integrity, _meta, _migrate, _settle, _state, _tree
from fleet.checkpoint._errors import Damaged, FleetCheckpointError, first_line
from fleet.runtime import _agree
from fleet.runtime._world import world


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


def latest(orbax: ocp.CheckpointManager, directory: str,
           contents: _state.Contents) -> Restored | None:
    """:func:`read` of the newest intact step of ``orbax`` (in ``directory``);
    ``None`` if there is none. Damaged steps are moved aside, with a warning
    (attributed to the caller of ``CheckpointManager.restore_latest``)."""
    damaged = []
    for step in reversed(sorted(orbax.all_steps())):
        try:
            return read(orbax, directory, step, contents)
        except Damaged as e:
            moved = _set_aside(orbax, directory, step)
            damaged.append(step)
            warnings.warn(f"{e}; skipped it (moved to {moved}) and trying the step before",
                          FleetWarning, stacklevel=3)
    if damaged:
        raise FleetCheckpointError(
            f"every checkpoint in {directory} is damaged (steps {damaged}, moved to "
            "<step>.damaged); nothing was restored"
        )
    return None


def _set_aside(orbax: ocp.CheckpointManager, directory: str, step: int) -> str:
    """Renames the damaged ``step`` so it is no longer listed (nor overwritten)."""
    target = ""
    if jax.process_index() == 0:
        source = os.path.join(directory, str(step))
        target, n = f"{source}.damaged", 1
        while os.path.lexists(target):
            n += 1
            target = f"{source}.damaged-{n}"
        os.rename(source, target)
    if jax.process_count() > 1:  # (the others wait for the rename, and name it alike)
        target = _agree.agree("fleet.CheckpointManager.restore_latest(set aside)", target)[0]
    orbax.reload()
    return target


def read(orbax: ocp.CheckpointManager, directory: str, step: int,
         contents: _state.Contents) -> Restored:
    """Restores ``step`` into ``contents``: checked, then read and verified, then set.

    Raises:
        FleetCheckpointError: the step does not fit ``contents`` (nothing changed).
        Damaged: the step cannot be read as it was written (nothing changed).
    """
    world()  # a clear error before orbax's if fleet.init was not called
    parts = contents.parts()
    meta = _meta.read(orbax, directory, step)
    problems = _problems(orbax, directory, step, meta, parts)
    if contents.loader is not None:
        problems += _state.loader_problems(contents.loader, meta.get("loader"))
    if problems:
        raise FleetCheckpointError(
            f"checkpoint {directory}/{step} does not fit what it is restored into "
            f"({len(problems)} difference{'s' if len(problems) > 1 else ''}; nothing was "
            "changed):\n  " + "\n  ".join(problems)
        )
    values = _read_verified(orbax, directory, step, meta, parts)
    new = {name: p.put(values[name] if p.leaves else {}) for name, p in parts.items()}
    if contents.loader is not None:
        contents.loader.set_state_dict(meta["loader"])
    return Restored(step=step, epoch=meta.get("epoch"), metadata=meta.get("metadata") or {},
                    state=new.get("state"), rng=new.get("rng"))


def _read_verified(orbax: ocp.CheckpointManager, directory: str, step: int,
                   meta: dict[str, Any], parts: dict[str, _state.Part]) -> dict[str, Any]:
    """The arrays of ``parts`` in ``step``, each verified against its checksum (the
    verdict agreed by every process); raises :class:`Damaged` if any is not."""
    args = {}
    for name, part in parts.items():
        if part.leaves:  # (an empty part has no orbax item)
            items, restore_args = part.targets()
            args[name] = ocp.args.PyTreeRestore(items, restore_args=restore_args)
    values, verdict = {}, ""
    try:
        with _settle.collect() as failed:  # (a failed read leaves nothing running)
            values = orbax.restore(step, args=ocp.args.Composite(**args)) if args else {}
        if failed:
            raise failed[0]
        verdict = _verdict(meta, {name: dict(values[name]) for name in args})
    except FleetError:
        raise
    except Exception as e:  # noqa: BLE001 (tensorstore's errors on damaged files)
        verdict = f"it cannot be read ({first_line(e)})"
    if jax.process_count() > 1:  # damaged for one process means damaged for all
        verdicts = _agree.agree("fleet.CheckpointManager.restore(verify)", verdict)
        verdict = next((f"{v} (found by rank {r})" for r, v in enumerate(verdicts) if v), "")
    if verdict:
        raise Damaged(f"checkpoint {directory}/{step} is damaged: {verdict}")
    return values


def _verdict(meta: dict[str, Any], values: dict[str, dict[str, Any]]) -> str:
    """Why the arrays read, ``{part: {key: value}}``, are not those the step's
    ``meta`` says were written ("" if they are). A step whose ``meta`` names its
    checksum (every step since fleet sums arrays) has one for every array: a
    table that is missing, unreadable or short is damage, never "not checked"."""
    written = meta.get("checksum") is not None
    sums = meta.get("checksums") if written else meta.get("checksums") or {}
    if not (isinstance(sums, dict) and all(_integrity.is_table(t) for t in sums.values())):
        return (f"its {_meta.NAME!r} item says its arrays were written with checksums "
                f"({meta['checksum']}), but their table is "
                f"{'missing' if sums is None else 'unreadable'}")
    bad = [f"{name} {b}" for name, part in values.items()
           for b in _integrity.mismatches(sums.get(name, {}), part)]
    lost = [f"{name} {k}" for name, part in values.items()
            for k in _integrity.missing(sums.get(name, {}), part)] if written else []
    return _integrity.damage(bad, lost, f" from its {_meta.NAME!r} item, which says every "
                                        f"array was written with one ({meta.get('checksum')})")


def _problems(orbax: ocp.CheckpointManager, directory: str, step: int, meta: dict,
              parts: dict[str, _state.Part]) -> list[str]:
    """Every way the arrays of ``step`` do not fit ``parts`` (a part whose object
    grows a gradient accumulator is replaced by the grown one; a part's leaves
    written under an earlier fleet's names are read under those,
    :mod:`fleet.checkpoint._migrate`)."""
    try:
        with _settle.collect() as failed:  # (a failed read leaves nothing running)
            items = orbax.metadata(step).item_metadata
        if failed:
            raise failed[0]
    except Exception as e:  # noqa: BLE001 (a deleted or cut-short metadata file)
        raise Damaged(f"checkpoint {directory}/{step} is damaged: its metadata "
                      f"cannot be read ({first_line(e)})") from None
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
            raise Damaged(f"checkpoint {directory}/{step} is damaged: the metadata "
                          f"of its {name!r} item is missing")
        saved = {k: (tuple(m.shape), np.dtype(m.dtype).name) for k, m in tree.items()}
        if _grows_accumulator(part, saved):
            part = parts[name] = _state.Part.of(name, part.obj)
        part.stored_as = _migrate.renames(name, saved, part.leaves)  # an earlier fleet's names
        saved = _migrate.as_today(saved, part.stored_as)
        problems += [f"{name}: {p}" for p in _tree.differences(
            saved, part.signatures(), meta["key_impls"].get(name, {}), part.impls())]
    return problems


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
