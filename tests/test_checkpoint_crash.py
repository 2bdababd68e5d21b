"""Writers that die or collide. Acceptance 3 (issue 10): ``kill -9`` during a save
leaves the previous checkpoint loadable, and the half-written one is never
listed. Issue 22: the next manager says which step was begun and never finished
(kill -9, ``os._exit``) and takes over the dead writer's lock with a warning; a
second job on one directory is refused, naming the first; ``fleet.save``
removes the temporary files a killed writer left.

The kill -9 worker saves every 3 steps with a 16 MB array in the checkpoint (a
slow save), and its save of step 6 can never commit (orbax's final rename
hangs). It is killed either while step 6 is being written (as soon as its
temporary directory appears) or at the commit itself (all files written,
commit marker included, only the rename missing).
"""

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from fleet import FleetWarning
from fleet.checkpoint import CheckpointManager, load, save
from fleet.checkpoint._pending import FINISHES_AT_EXIT
from tests.tiers import slow
from tests.workers import ckpt_common, ckpt_jobs

HOST = re.escape(socket.gethostname())
EXIT_WORKER = str(ckpt_jobs.ROOT / "tests/workers/ckpt_exit.py")
TWO_JOBS = str(ckpt_jobs.ROOT / "tests/workers/ckpt_two_jobs.py")


def same_bits(got, want) -> bool:
    got = np.asarray(got)
    return got.dtype == want.dtype and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("moment", [pytest.param("writing", marks=slow), "commit"])
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
    with pytest.warns(FleetWarning, match=rf"CheckpointManager: {ckpt} was left locked by pid "
                                          rf"{proc.pid} on host {socket.gethostname()} .*which "
                                          r"ended without closing.*takes the directory over; "
                                          r"the save of step 6 was begun and never finished"):
        manager = CheckpointManager(ckpt, save_interval_steps=3)
    with manager:
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
    assert sorted(p.name for p in ckpt.iterdir()) == [".fleet-lock", "3", "6"]  # partial one removed


# -- issue 22, item 8: a step begun and never finished is said, not silently missing --------------

@slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not FINISHES_AT_EXIT, reason="no asynchronous save on CPython 3.12.0-3.12.2")
def test_os_exit_right_after_an_async_save_is_said_by_the_next_manager(make_world, tmp_path):
    """``os._exit(0)`` skips every exit hook, so nothing can finish the save of step
    2; the next manager finds it in the dead writer's lock file and says so."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, EXIT_WORKER, "os-exit", str(ckpt), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ckpt_jobs._env(1))
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and "saving step 2; ending without close()" in out, out
    make_world(1)
    with pytest.warns(FleetWarning, match=rf"CheckpointManager: {ckpt} was left locked by pid "
                                          rf"{proc.pid} on host {HOST} .*os._exit\); this process takes"
                                          r" the directory over; the save of step 2 was begun and "
                                          r"never finished: it is not listed \(the newest complete "
                                          r"step is 1; partial files are removed\)"):
        manager = CheckpointManager(ckpt)
    with manager:
        assert manager.all_steps() == [1]
        want = np.load(tmp_path / "expected-1.npy")
        assert same_bits(manager.restore_latest(state={"w": np.zeros_like(want)}).state["w"], want)
    assert sorted(os.listdir(ckpt)) == [".fleet-lock", "1"]


def test_a_stale_lock_is_taken_over_with_a_warning(make_world, tmp_path):
    """The lock file names a writer of this host whose process is gone (no flock
    held on it): the next manager warns, naming that pid and host and the step it
    never finished, and the directory is this process's from then on. (A writer of
    another host: tests/test_launch_faults.py, issue 38.)"""
    make_world(1)
    ckpt = tmp_path / "ckpt"
    with CheckpointManager(ckpt, async_save=False) as manager:
        manager.save(1, state={"w": np.arange(5.0)})
    dead = subprocess.Popen(["true"])  # (a pid that has ended)
    dead.wait()
    (ckpt / ".fleet-lock").write_text(json.dumps({
        "host": socket.gethostname(), "pid": dead.pid, "job": "job-before", "processes": 2,
        "since": "2026-11-24 09:00:00", "saving": 2}))
    with pytest.warns(FleetWarning, match=rf"CheckpointManager: {ckpt} was left locked by pid "
                                          rf"{dead.pid} on host {HOST} \(job job-before, process 0 "
                                          r"of 2, since 2026-11-24 09:00:00\), which ended without "
                                          r"closing its CheckpointManager.*takes the directory over; "
                                          r"the save of step 2 was begun and never finished"):
        manager = CheckpointManager(ckpt, async_save=False)
    with manager:
        holder = json.loads((ckpt / ".fleet-lock").read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        assert same_bits(manager.restore_latest(state={"w": np.zeros(5)}).state["w"], np.arange(5.0))
        assert manager.save(2, state={"w": np.ones(5)})
    assert (ckpt / ".fleet-lock").read_text() == ""  # closed: no writer named


def test_a_partial_step_is_said_and_removed(make_world, tmp_path):
    """A step's temporary directory with no lock file left (an earlier fleet's
    writer, killed): the manager says the step was never finished."""
    make_world(1)
    ckpt = tmp_path / "ckpt"
    with CheckpointManager(ckpt, async_save=False) as manager:
        manager.save(1, state={"w": np.arange(5.0)})
    (ckpt / ".fleet-lock").unlink(missing_ok=True)
    (ckpt / "2.orbax-checkpoint-tmp-1732442400123").mkdir()
    (ckpt / "2.orbax-checkpoint-tmp-1732442400123/part").write_bytes(b"half")
    with pytest.warns(FleetWarning, match=rf"CheckpointManager: in {ckpt}, the save of step 2 was "
                                          r"begun and never finished: it is not listed \(the newest "
                                          r"complete step is 1; partial files are removed\); its "
                                          r"writer ended while saving"):
        manager = CheckpointManager(ckpt)
    with manager:
        assert manager.all_steps() == [1]
    assert sorted(os.listdir(ckpt)) == [".fleet-lock", "1"]


# -- issue 22, item 3: one writer a directory ---------------------------------------------------

@slow
@pytest.mark.timeout(180)
def test_a_second_job_on_one_directory_is_refused(make_world, tmp_path):
    """Two single-process jobs make their managers on one directory at once, then
    save steps 1-8: one is refused at CheckpointManager(...), naming the other's
    pid and host; every step of the other restores bitwise."""
    ckpt = tmp_path / "ckpt"
    logs = {tag: open(tmp_path / f"{tag}.log", "w+") for tag in "ab"}
    procs = {tag: subprocess.Popen([sys.executable, TWO_JOBS, str(ckpt), str(tmp_path), tag],
                                   stdout=logs[tag], stderr=subprocess.STDOUT, env=ckpt_jobs._env(1))
             for tag in "ab"}
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{tag}").exists() for tag in "ab"):
            assert time.monotonic() < deadline and all(p.poll() in (None, 0) for p in procs.values())
            time.sleep(0.05)
        (tmp_path / "go").touch()
        codes = {tag: p.wait(timeout=120) for tag, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    out = {tag: (tmp_path / f"{tag}.log").read_text() for tag in "ab"}
    assert codes == {"a": 0, "b": 0}, out
    (loser,) = [tag for tag in "ab" if "refused:" in out[tag]]
    winner = "b" if loser == "a" else "a"
    assert re.search(rf"refused: CheckpointManager: {ckpt} is being written by another job \(pid "
                     rf"{procs[winner].pid} on host {HOST} \(since [^)]*\)\); a checkpoint "
                     r"directory has one writer at a time: wait until that job ends, or give this "
                     r"job another directory", out[loser]), out[loser]
    assert f"{winner}: saved steps 1 to 8" in out[winner], out[winner]
    make_world(1)
    with CheckpointManager(ckpt) as manager:  # (no warning: the writer closed its manager)
        assert manager.all_steps() == list(range(1, 9))
        for step in range(1, 9):
            want = np.load(tmp_path / f"{winner}-{step}.npy")
            assert same_bits(manager.restore(step, state={"w": np.zeros_like(want)}).state["w"], want)


# -- issue 22, item 8: fleet.save removes what killed writers left --------------------------------

def test_fleet_save_removes_the_temporary_files_of_dead_writers(tmp_path):
    """A ``.NAME.fleet-new-*`` file whose writer is gone (no lock held) is removed
    at the next save to NAME; one a live writer holds is left alone."""
    path = tmp_path / "model.pdparams"
    save({"w": np.arange(3.0)}, path)
    dead = tmp_path / ".model.pdparams.fleet-new-0-4242-0badf00d"
    live = tmp_path / ".model.pdparams.fleet-new-0-4343-0c0ffee0"
    other = tmp_path / ".other.pdparams.fleet-new-0-4444-0d15ea5e"
    for leftover in (dead, live, other):
        leftover.write_bytes(b"PK\x03\x04 half a checkpoint")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # (as a live writer holds its temporary file)
        save({"w": np.arange(4.0)}, path)
        assert sorted(os.listdir(tmp_path)) == [live.name, other.name, "model.pdparams"]
    save({"w": np.arange(5.0)}, path)
    assert sorted(os.listdir(tmp_path)) == [other.name, "model.pdparams"]
    assert same_bits(load(path)["w"], np.arange(5.0))


KILLED_SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from fleet.checkpoint import save
    w = np.random.RandomState(0).rand(4_000_000)
    for i in range(10_000):
        save({"w": w, "i": i}, sys.argv[1])
""")


@slow
@pytest.mark.timeout(180)
def test_kill_9_during_a_fleet_save_loop_leaves_nothing_after_the_next_save(tmp_path):
    path = tmp_path / "model.pdparams"
    for _ in range(5):  # (until the kill lands while a temporary file is being written)
        proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(path)], cwd=ckpt_jobs.ROOT,
                                env=ckpt_jobs._env(1))
        try:
            deadline = time.monotonic() + 60
            while not (path.exists() and list(tmp_path.glob(".model.pdparams.fleet-new-*"))):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.005)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.wait()
        if list(tmp_path.glob(".model.pdparams.fleet-new-*")):
            break
    leftovers = list(tmp_path.glob(".model.pdparams.fleet-new-*"))
    assert leftovers and load(path)["w"].shape == (4_000_000,)  # the last complete one loads
    save({"w": np.arange(3.0)}, path)
    assert sorted(os.listdir(tmp_path)) == ["model.pdparams"]
    assert same_bits(load(path)["w"], np.arange(3.0))
