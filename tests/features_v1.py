"""Issue 36 item 2: three runs whose optimizer keeps strategy features' state
(gradient merge's count, float16 amp's loss scale, a check_nan_inf skipped
call), checkpointed mid-way. ``tests/data/checkpoint/features_v1`` holds the
checkpoints that fleet at commit 8bfd251 wrote of them (its optimizer kept that
state as top-level variables, ``merge_count``, ``loss_scaling``...);
tests/test_checkpoint_features_v1.py restores them with this fleet.

Only public API here: the same file wrote them with the earlier fleet. To write
them again (never with a newer fleet), from a checkout of that commit with this
file and the README's command::

    python -m tests.features_v1 <directory>
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import fleet
from fleet.runtime import _world
from tests import models


def _strategy(**sections) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    for name, value in sections.items():
        setattr(s, name, value)
    return s


FP16 = {"dtype": "float16", "init_loss_scaling": 1024.0, "incr_every_n_steps": 2,
        "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.5}

#: name -> (strategy sections, learning rate, calls, the call saved after, calls not finite)
RUNS = {
    # gradient merge k=4: saved on call k-1 of the second cycle (merge_count 3)
    "merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 4}},
              models.LR, 8, 7, ()),
    # float16 amp: 1024 -> 2048 (two finite) -> 1024 (two not) -> bad_steps 1 when saved
    "amp": ({"amp": True, "amp_configs": FP16}, 1e-2, 10, 6, (2, 3, 5, 8)),
    # check_nan_inf: call 2 is not finite (raised, skipped), saved after call 4
    "nan": ({"check_nan_inf": True}, 1e-2, 6, 4, (2,)),
}

DEVICES = 4


def build(name: str):
    """A fresh world, model, distributed optimizer and step for run ``name``."""
    sections, lr = RUNS[name][:2]
    _world._WORLD = None  # (a test world, as tests/conftest.py makes it)
    fleet.init(is_collective=True, strategy=_strategy(**sections),
               devices=jax.devices()[:DEVICES])
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param))
    return model, opt, fleet.distributed_step(models.nnx_train_step)


def calls(name: str, model, opt, step, start: int, stop: int) -> list[str]:
    """Calls ``start`` .. ``stop - 1`` of run ``name`` (each waited for); the
    check_nan_inf errors they raise, by call."""
    _, _, total, _, bad = RUNS[name]
    data = models.batches("linear", total, 8)
    errors = []
    for i in range(start, stop):
        x, y = data[i]
        if i in bad:
            x = x.copy()
            x[2, 0] = np.inf  # replica 1 of 4 only
        try:
            step(model, opt, x, y)
            step.wait()
        except fleet.FleetError as e:
            errors.append(f"{i}: {e}")
    return errors


def write(directory: Path) -> None:
    for name, (_, _, _, saved, _) in RUNS.items():
        model, opt, step = build(name)
        print(name, calls(name, model, opt, step, 0, saved))
        with fleet.CheckpointManager(directory / name, async_save=False) as manager:
            manager.save(saved, model=model, optimizer=opt)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
