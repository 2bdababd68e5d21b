"""Issue 19: checkpoints written by earlier fleets still load (tests/data/checkpoint,
written at commit fc8d239): the orbax directory of the earlier fleet.save, and a
CheckpointManager step, which this fleet also writes in the same layout."""

import json
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager, FleetCheckpointError, load, save
from tests.test_checkpoint_file import assert_same

DATA = Path(__file__).parent / "data" / "checkpoint"
OLD_SAVE = DATA / "fleet_save_directory_format.pdparams"
OLD_STEPS = DATA / "manager_v1"


OLD_EXPECTED = {  # what tests/data/checkpoint/README.md says was saved, as loaded then and now
    "count": np.arange(4, dtype=np.int32), "epoch": 3, "flag": True,
    "key": np.array([0, 1], np.uint32),
    "linear": {"bias": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
               "kernel": np.arange(6, dtype=np.float32).reshape(2, 3) / 7},
    "list": [np.ones(2, np.int8), 7, [2.5, "x"]], "lr": 0.5, "name": "adam",
    "np_float": 0.125, "np_int": -9, "zero_d": np.array(3.25),
}


def test_loads_the_directory_format_of_the_earlier_fleet_save(tmp_path):
    assert_same(load(OLD_SAVE), OLD_EXPECTED)
    damaged = tmp_path / "old.pdparams"
    shutil.copytree(OLD_SAVE, damaged)
    sums = json.loads((damaged / "fleet_checksums.json").read_text())
    sums["arrays"]["['linear']['kernel']"] ^= 1
    (damaged / "fleet_checksums.json").write_text(json.dumps(sums))
    with pytest.raises(FleetCheckpointError, match=r"old.pdparams is damaged: 1 array does not match "
                                                   r"the checksum written with it:\n  \['linear'\]"
                                                   r"\['kernel'\]: crc32"):
        load(damaged)


@pytest.mark.parametrize("swap", ["renameat2", "move aside"])
def test_saving_over_an_earlier_directory_replaces_it_with_a_file(tmp_path, monkeypatch, swap):
    from fleet.checkpoint import _atomic

    if swap == "move aside":  # (a system without an atomic swap)
        monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    path = tmp_path / "model.pdparams"
    shutil.copytree(OLD_SAVE, path)
    save({"w": np.arange(3.0)}, path)
    assert path.is_file() and sorted(os.listdir(tmp_path)) == ["model.pdparams"]
    assert_same(load(path), {"w": np.arange(3.0)})


def test_a_step_written_by_the_earlier_fleet_restores_and_its_parts_load(make_world, tmp_path):
    make_world(1)
    steps = tmp_path / "ckpt"
    shutil.copytree(OLD_STEPS, steps)
    assert_same(load(steps / "3/state"), {"b": np.full(2, 0.5, np.float32),
                                         "w": np.arange(5, dtype=np.float32)})
    with CheckpointManager(steps, async_save=False) as manager:
        restored = manager.restore(3, state={"w": np.zeros(5, np.float32),
                                             "b": jax.numpy.zeros(2)}, rng=jax.random.key(0))
        assert (restored.step, restored.epoch, restored.metadata) == (3, 1, {"note": "v1"})
        assert_same(np.asarray(restored.state["w"]), np.arange(5, dtype=np.float32))
        assert_same(np.asarray(restored.state["b"]), np.full(2, 0.5, np.float32))
        assert_same(np.asarray(jax.random.key_data(restored.rng)), np.array([0, 7], np.uint32))
        # What this fleet writes is laid out as what the earlier one wrote.
        manager.save(4, state=restored.state, rng=restored.rng, epoch=1, metadata={"note": "v1"})

    def layout(step):
        return sorted(str(p.relative_to(step)) for p in step.rglob("*")
                      if "/d/" not in f"/{p.relative_to(step)}" and p.name != "d")

    assert layout(steps / "4") == layout(steps / "3")
    old_meta, new_meta = (json.loads((steps / f"{s}/meta/metadata").read_text()) for s in (3, 4))
    assert new_meta == dict(old_meta, step=4)
    handlers = [json.loads((steps / f"{s}/_CHECKPOINT_METADATA").read_text())["item_handlers"]
                for s in (3, 4)]
    assert handlers[0] == handlers[1]
