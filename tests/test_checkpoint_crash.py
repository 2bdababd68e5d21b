"""Acceptance 3: ``kill -9`` during a save leaves the previous checkpoint loadable,
and the half-written one is never listed.

The worker saves every 3 steps with a 16 MB array in the checkpoint (a slow
save), and its save of step 6 can never commit (orbax's final rename hangs). It
is killed either while step 6 is being written (as soon as its temporary
directory appears) or at the commit itself (all files written, commit marker
included, only the rename missing).
"""

import os
import signal
import time

import pytest

from fleet.checkpoint import CheckpointManager
from tests.workers import ckpt_common, ckpt_jobs


@pytest.mark.parametrize("moment", ["writing", "commit"])
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(make_world, tmp_path, moment):
    ckpt, log = tmp_path / "ckpt", tmp_path / "worker.log"
    proc = ckpt_jobs.start(["--devices", 1, "--dir", ckpt, "--save-every", 3, "--steps", 100,
                            "--sync", "--hang-commit", 6, "--big", 4_000_000,
                            "--dump", f"3:{tmp_path / 'at3.npz'}"], 1, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            partial = list(ckpt.glob("6.orbax-checkpoint-tmp*"))
            text = log.read_text(errors="replace")
            if (moment == "writing" and partial) or "COMMIT-HANG" in text:
                break
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    print(f"killed {'after' if 'COMMIT-HANG' in text else 'before'} the commit began")
    assert partial and not (ckpt / "6").exists()

    make_world(1)
    job = ckpt_common.build()
    with CheckpointManager(ckpt, save_interval_steps=3) as manager:
        assert manager.all_steps() == [3] and manager.latest_step() == 3
        job.restore(manager)  # restore_latest
        assert job.step == 3
        restored = ckpt_common.snapshot(job)
        restored.pop("loader")  # reported only once iteration starts (fleet.io)
        ckpt_common.assert_bitwise_equal(restored, ckpt_jobs.load(tmp_path / "at3.npz",
                                                                  drop=("loader",)))
        ckpt_common.train(job, 6, manager)  # the job goes on, and saves step 6 again
        manager.wait_until_finished()
        assert manager.all_steps() == [3, 6]
    assert sorted(p.name for p in ckpt.iterdir()) == ["3", "6"]  # the partial one removed
