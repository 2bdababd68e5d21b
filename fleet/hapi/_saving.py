"""``Model.save`` / ``Model.load``: parameters and optimizer state, Paddle's names.

``save(path)`` writes ``{path}.pdparams`` (every variable of the network, keyed
as ``network.state_dict()``: ``"linear1.kernel"``) and, for training,
``{path}.pdopt`` (the optimizer's state, keyed the same way: ``"step"``,
``"opt_state.0.mu.linear1.kernel"``), each with :func:`fleet.save` (one file,
as Paddle writes, replaced atomically; loading never unpickles). The first worker
writes; the others wait for it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fleet import checkpoint
from fleet._errors import FleetError
from fleet.checkpoint import _migrate
from fleet.runtime import _world
from fleet.runtime._leaves import state_dict
from fleet.runtime._replicate import load_state_dict

PARAMS_SUFFIX = ".pdparams"
OPT_SUFFIX = ".pdopt"


def write_arrays(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes ``arrays`` to ``path`` with :func:`fleet.save`, on the first worker."""
    if _world.is_first_worker():
        checkpoint.save(arrays, path)
    _world.barrier_worker()


def read_arrays(path: str, what: str) -> dict[str, np.ndarray]:
    if not os.path.exists(path):
        raise FleetError(
            f"no {what} file at {path!r}; pass the path given to Model.save (without the "
            f"{PARAMS_SUFFIX} / {OPT_SUFFIX} suffix)"
        )
    return checkpoint.load(path)


def optimizer_state_dict(optimizer: Any) -> dict[str, np.ndarray]:
    return state_dict(optimizer)


def set_optimizer_state_dict(optimizer: Any, state: dict[str, Any]) -> None:
    """Loads values saved by :func:`optimizer_state_dict` (by this fleet or an
    earlier one, :mod:`fleet.checkpoint._migrate`); all or nothing."""
    state = _migrate.as_today(state, _migrate.renames("optimizer", state, state_dict(optimizer)))
    load_state_dict(optimizer, state, "optimizer",
                    "Build the same optimizer as when saving, or load with reset_optimizer=True",
                    intro="the saved optimizer state does not fit this optimizer")


def fit_params(network: Any, params: dict[str, np.ndarray]) -> tuple[dict, list[str]]:
    """For ``skip_mismatch``: the saved values whose key and shape fit the network
    (others keep their current value), and what was skipped."""
    current = network.state_dict()
    merged, skipped = dict(current), []
    for key, value in params.items():
        if key not in current:
            skipped.append(f"{key!r} (not in the network)")
        elif current[key].shape != value.shape or current[key].dtype != value.dtype:
            skipped.append(f"{key!r} (file {value.shape} {value.dtype}, network "
                           f"{current[key].shape} {current[key].dtype})")
        else:
            merged[key] = value
    return merged, skipped
