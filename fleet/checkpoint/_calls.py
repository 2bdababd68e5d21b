"""What a call of ``fleet.CheckpointManager`` (``_manager.py``) checks before it
acts: its arguments (an interval, a step number), and that every process makes
it.

Collective calls (the constructor, ``save`` when it writes, ``restore``,
``restore_latest``, ``wait_until_finished``, ``close``) first meet the other
processes through :func:`fleet.runtime._agree.agree`: a process that does not make the
call ends them within ``FLEET_AGREE_TIMEOUT`` seconds (60) with an error naming
the call and the missing ranks, instead of a hang in orbax's barriers. (Moved
out of ``_manager.py``, which keeps the class and its save policy.)
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from fleet.checkpoint._errors import FleetCheckpointError
from fleet.runtime import _agree


def positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise FleetCheckpointError(f"{name} must be an int >= 1 or None, got {value!r}")
    return int(value)


def step_number(step: Any) -> int:
    if isinstance(step, jax.Array) and step.ndim == 0:
        step = int(np.asarray(step.addressable_shards[0].data))
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise FleetCheckpointError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def meet(call: str, value: Any) -> None:
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


def as_on_process_0(call: str, answer: bool) -> bool:
    """``answer`` as process 0 gave it (a bounded wait), so that every process
    decides the same (a save interval in seconds)."""
    if jax.process_count() == 1:
        return answer
    return _agree.agree(call, str(int(answer)))[0] == "1"
