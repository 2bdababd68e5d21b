"""Acceptance 1 in one process: 14 steps straight vs 7 steps, save, a new process
restores and trains 7 more -- bitwise the same parameters, optimizer state, RNG
and loader position, on 1 device and on 4.

The job (tests/workers/ckpt_common.py) has batch norm, dropout, a shuffling
sampler (step 7 is in the middle of the second epoch) and a PRNG key the loop
splits every step, so every part of the state must come back for equality. The
straight run saves at step 7 on its way (a save changes nothing:
test_checkpoint.py::test_async_save_changes_nothing).
"""

import jax
import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager
from fleet.io import DataLoader, DistributedBatchSampler
from tests import tiers
from tests.workers import ckpt_common, ckpt_jobs

STEPS, MIDDLE = 14, 7


@pytest.mark.parametrize("devices", tiers.devices(1, 4))
def test_resume_in_a_new_process_is_bitwise_exact(make_world, tmp_path, devices):
    make_world(devices)
    job = ckpt_common.build()
    with CheckpointManager(tmp_path / "ckpt", save_interval_steps=MIDDLE) as manager:
        reference = ckpt_common.snapshot(ckpt_common.train(job, STEPS, manager))
        assert manager.all_steps() == [MIDDLE, STEPS]

    out = tmp_path / "resumed.npz"
    ckpt_jobs.run_one(tmp_path, ["--devices", devices, "--restore", f"{tmp_path / 'ckpt'}:{MIDDLE}",
                                 "--steps", STEPS, "--out", out], devices=devices)
    ckpt_common.assert_bitwise_equal(ckpt_jobs.load(out), reference)

    # The comparison notices a part left out: resuming without the loader position,
    # or without the script's RNG key, trains something else.
    with CheckpointManager(tmp_path / "ckpt") as manager:
        for left_out in ("loader", "rng"):
            job.restore(manager, MIDDLE)
            if left_out == "loader":
                dataset = job.loader.dataset
                job.loader = DataLoader(dataset, batch_sampler=DistributedBatchSampler(
                    dataset, job.loader.batch_sampler.batch_size, shuffle=True, drop_last=True))
            else:
                job.rng = jax.random.key(7)
            got = ckpt_common.snapshot(ckpt_common.train(job, STEPS))
            assert not np.array_equal(got["model/linear1.kernel"],
                                      reference["model/linear1.kernel"]), left_out
