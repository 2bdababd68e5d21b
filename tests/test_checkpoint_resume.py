"""Acceptance 1 in one process: 14 steps straight vs 7 steps, save, a new process
restores and trains 7 more -- bitwise the same parameters, optimizer state, RNG
and loader position, on 1 device and on 4.

The job (tests/workers/ckpt_common.py) has batch norm, dropout, a shuffling
sampler (step 7 is in the middle of the second epoch) and a PRNG key the loop
splits every step, so every part of the state must come back for equality.
"""

import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager
from tests.workers import ckpt_common, ckpt_jobs

STEPS, MIDDLE = 14, 7


@pytest.mark.parametrize("devices", [1, 4])
def test_resume_in_a_new_process_is_bitwise_exact(make_world, tmp_path, devices):
    make_world(devices)
    reference = ckpt_common.snapshot(ckpt_common.train(ckpt_common.build(), STEPS))

    job = ckpt_common.build()
    with CheckpointManager(tmp_path / "ckpt", save_interval_steps=MIDDLE) as manager:
        ckpt_common.train(job, MIDDLE, manager)
        assert manager.all_steps() == [MIDDLE]

    out = tmp_path / "resumed.npz"
    log = ckpt_jobs.run_one(tmp_path, ["--devices", devices, "--dir", tmp_path / "ckpt",
                                       "--save-every", MIDDLE, "--resume", "--steps", STEPS,
                                       "--out", out], devices=devices)
    assert f"resumed at step {MIDDLE}" in log
    ckpt_common.assert_bitwise_equal(ckpt_jobs.load(out), reference)


def test_every_part_of_the_state_matters(make_world, tmp_path):
    """The comparison above would notice a part left out: resuming without the
    loader position, or without the script's RNG key, trains something else."""
    make_world(4)
    reference = ckpt_common.snapshot(ckpt_common.train(ckpt_common.build(), STEPS))
    job = ckpt_common.build()
    with CheckpointManager(tmp_path / "ckpt", save_interval_steps=MIDDLE) as manager:
        ckpt_common.train(job, MIDDLE, manager)
        for left_out in ("loader", "rng"):
            job = ckpt_common.build()
            parts = job.parts()
            parts.pop(left_out)
            restored = manager.restore(MIDDLE, **parts)
            job.step = restored.step
            if left_out != "rng":
                job.rng = restored.rng
            got = ckpt_common.snapshot(ckpt_common.train(job, STEPS))
            assert not np.array_equal(got["model/linear1.kernel"], reference["model/linear1.kernel"])
