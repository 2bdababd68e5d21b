"""Issue 10 across real processes (fleetrun, 2 processes x 2 CPU devices):
``fleet.save`` from rank 1 alone or from every rank writes the full data;
collective checkpoint calls made on one rank only end the job within 60 s with
a message naming the call and the missing rank; a damaged step is skipped by
every process alike."""

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager
from tests import jobs
from tests.tiers import slow
from tests.workers import ckpt_jobs

pytestmark = slow  # multi-process checkpoint faults

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

WORKER = str(ckpt_jobs.ROOT / "tests/workers/ckpt_collective.py")


def fleetrun(tmp_path: Path, case: str, timeout: float = 60) -> tuple[int, str, list[str], float]:
    """Runs the worker's ``case`` as a fleetrun job; returns (exit code, console,
    each rank's log, seconds). Kills the job if it outlives ``timeout``."""
    job = jobs.two_processes(tmp_path, WORKER, case, str(tmp_path), timeout=timeout, ok=False,
                             env={"FLEET_AGREE_TIMEOUT": "10"})
    return job.returncode, job.output, [log for log in job.logs(2) if log], job.seconds


def assert_loaded_bitwise(tmp_path: Path) -> None:
    want = np.load(tmp_path / "expected.npz")
    for rank in (0, 1):
        got = np.load(tmp_path / f"loaded-{rank}.npz")
        assert sorted(got) == sorted(want) == ["['b']", "['nested']['k']", "['step']", "['w']"]
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes()


@pytest.mark.parametrize("case", ["save-rank1", "save-all"])
def test_fleet_save_from_any_rank_writes_the_full_data(tmp_path, case):
    code, out, _, _ = fleetrun(tmp_path, case)
    assert code == 0, out[-4000:]
    assert_loaded_bitwise(tmp_path)
    # No temporary or set-aside copies left, whoever saved.
    # (job.out and job-log/ are the launcher's console and logs, tests/jobs.py)
    assert ("leftovers: ['expected.npz', 'job-log', 'job.out', 'loaded-0.npz', 'loaded-1.npz', "
            "'model.pdparams']") in out, out[-4000:]


@pytest.mark.parametrize("case, call", [
    ("manager-rank0", r"fleet.CheckpointManager\(\)"),
    ("save-rank0", "fleet.CheckpointManager.save"),
])
def test_a_collective_call_on_one_rank_ends_the_job_naming_it(tmp_path, case, call):
    code, out, _, seconds = fleetrun(tmp_path, case)
    assert code != 0 and seconds < 60, out[-4000:]
    assert re.search(rf"FleetTimeoutError: {call}: process 0 waited 10 s for every process to "
                     r"make this call, but rank\(s\) \[1\] did not", out), out[-4000:]


def test_two_processes_skip_a_damaged_step_alike(tmp_path, make_world):
    """A step whose array data has a flipped byte: both processes warn, restore
    the step before, bitwise."""
    import jax

    world = make_world(2)
    w = {1: np.random.RandomState(1).randn(64, 32).astype(np.float32)}
    w[2] = w[1] + 1
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, state={"w": jax.device_put(w[step], world.replicated)})
    data = [p for p in (tmp_path / "ckpt/2/state").rglob("d/*")]
    target = max(data, key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    np.savez(tmp_path / "expected.npz", **{"['w']": w[1]})
    code, out, logs, _ = fleetrun(tmp_path, "restore-damaged")
    assert code == 0, out[-4000:]
    for rank, log in enumerate(logs):
        assert "FleetWarning: checkpoint " in log and "ckpt/2 is damaged: 1 array does not match " \
            "the checksum" in log, log[-3000:]
        assert f"rank {rank}: restored step 1" in log
        got = np.load(tmp_path / f"loaded-{rank}.npz")["['w']"]
        assert got.tobytes() == w[1].tobytes()
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".fleet-lock", "1", "2.damaged"]
