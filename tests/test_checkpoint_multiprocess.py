"""Checkpoints across real processes (2 processes x 2 CPU devices, gloo on 127.0.0.1).

One uninterrupted 2-process run (14 steps, saving at 7 and 14) is the reference
for: a resume in new processes (acceptance 1), restores across process counts
(acceptance 2), and a job whose worker is killed and restarted by ``fleetrun
--max_restarts 1`` (acceptance 4). Step 7 is in the middle of the second epoch.

Right after ``set_state_dict`` a loader's ``state_dict()`` reports the start of
the epoch (fleet.io reports a pending resume only once iteration starts), so
snapshots taken right after a restore leave the loader out; the snapshot one
step later checks the position.
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager
from tests import jobs
from tests.tiers import slow
from tests.workers import ckpt_common, ckpt_jobs

pytestmark = slow  # resume and restart across real processes

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

STEPS, MIDDLE = 14, 7


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2 processes x 2 devices train 14 steps straight; checkpoints at 7 and 14."""
    d = tmp_path_factory.mktemp("uninterrupted")
    ckpt_jobs.run_two(d, ["--steps", STEPS, "--dir", d / "ckpt", "--save-every", MIDDLE,
                          "--dump", f"7:{d / 'at7.npz'}", "--dump", f"8:{d / 'at8.npz'}",
                          "--out", d / "final.npz"])
    return d


def assert_close(got: dict, want: dict) -> None:
    """Another process count sums gradients in another order: floats agree to
    rounding after one step; counters, keys and the loader position exactly."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if value.dtype.kind == "f":
            np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-6, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_resume_in_new_processes_is_bitwise_exact(uninterrupted, tmp_path, make_world):
    """Acceptance 1 (2 processes x 2 devices) and 2 (1 process -> 2 processes)."""
    # A checkpoint written by one process (4 devices) for the new processes to probe.
    make_world(4)
    job = ckpt_common.build()
    with CheckpointManager(tmp_path / "one", save_interval_steps=MIDDLE) as manager:
        ckpt_common.train(job, MIDDLE, manager)
    at7 = ckpt_common.snapshot(job)
    at8 = ckpt_common.snapshot(ckpt_common.train(job, MIDDLE + 1))

    probe = tmp_path / "probe.npz"
    ckpt_jobs.run_two(tmp_path, [
        "--probe", f"{tmp_path / 'one'}:{MIDDLE}:{probe}",
        "--restore", f"{uninterrupted / 'ckpt'}:{MIDDLE}", "--steps", STEPS,
        "--dir", tmp_path / "every-minute", "--save-seconds", 60,
        "--out", tmp_path / "resumed.npz"])
    # Trained 7, saved, new processes restored and trained 7 more: bitwise the same.
    ckpt_common.assert_bitwise_equal(ckpt_jobs.load(tmp_path / "resumed.npz"),
                                     ckpt_jobs.load(uninterrupted / "final.npz"))
    # The 1-process checkpoint, restored by 2 processes: bitwise what was saved.
    at7.pop("loader")
    ckpt_common.assert_bitwise_equal(ckpt_jobs.load(probe, drop=("loader",)), at7)
    assert_close(ckpt_jobs.load(f"{probe}.next.npz"), at8)
    # Saving every 60 seconds, decided on process 0 for both: the first step after
    # the restore (no checkpoint yet), then only the last one (forced).
    with CheckpointManager(tmp_path / "every-minute") as manager:
        assert manager.all_steps() == [MIDDLE + 1, STEPS]


def test_two_process_checkpoint_restores_in_one_process(uninterrupted, make_world):
    """Acceptance 2 (2 processes -> 1 process with 4 devices)."""
    make_world(4)
    job = ckpt_common.build()
    with CheckpointManager(uninterrupted / "ckpt") as manager:
        assert manager.all_steps() == [MIDDLE, STEPS]
        job.restore(manager, MIDDLE)
    assert job.step == MIDDLE
    restored = ckpt_common.snapshot(job)
    restored.pop("loader")
    ckpt_common.assert_bitwise_equal(restored, ckpt_jobs.load(uninterrupted / "at7.npz",
                                                              drop=("loader",)))
    assert_close(ckpt_common.snapshot(ckpt_common.train(job, MIDDLE + 1)),
                 ckpt_jobs.load(uninterrupted / "at8.npz"))


def test_fleetrun_restart_resumes_from_the_last_checkpoint(uninterrupted, tmp_path):
    """Acceptance 4: rank 1 is killed (SIGKILL) after step 8; the restarted job
    resumes from the last complete checkpoint and ends bitwise like the
    uninterrupted run."""
    out = tmp_path / "final.npz"
    job = jobs.Job(tmp_path, "--nproc_per_node", "2", "--cpu_devices", "2", "--max_restarts", "1",
                   ckpt_jobs.WORKER, "--steps", str(STEPS), "--dir", str(tmp_path / "ckpt"),
                   "--save-every", "3", "--resume", "--kill-at", "8", "--out", str(out))
    try:
        job.wait(timeout=150)
    finally:
        left = job.end()
    text = job.output
    assert job.returncode == 0, text
    assert not left, f"processes of job {job.job_id} remain: {left}"
    assert "restarting all 2 workers (restart 1 of 1)" in text, text
    logs = job.logs(2)
    assert "killing myself" in logs[1]
    # The last complete checkpoint: 6, or 3 if the asynchronous save of step 6 was
    # still being written when rank 1 died.
    resumed = {re.search(r"rank \d restart 1\n(?:.*\n)*?resumed at step (\d+)", log)[1]
               for log in logs}
    assert len(resumed) == 1 and resumed <= {"3", "6"}, logs
    ckpt_common.assert_bitwise_equal(ckpt_jobs.load(out), ckpt_jobs.load(uninterrupted / "final.npz"))
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.all_steps() == [9, 12, 14]  # max_to_keep=3; 14 saved at the end
