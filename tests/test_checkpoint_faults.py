"""Issue 10, acceptance 2: checkpoint faults. After a flipped byte, a cut-short
file, a deleted manifest, a full disk (an injected ENOSPC, and a real 2 MB tmpfs
where one can be mounted), a script that ends without ``close()`` (kill -9 is in
test_checkpoint_crash.py), the newest intact checkpoint restores bitwise and
nothing damaged is ever returned."""

import errno
import glob
import os
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from fleet import FleetWarning
from fleet.checkpoint import CheckpointManager, FleetCheckpointError, load, save
from tests.workers import ckpt_jobs

EXIT_WORKER = str(ckpt_jobs.ROOT / "tests/workers/ckpt_exit.py")


def values(step: int) -> dict:
    rs = np.random.RandomState(step)
    return {"w": rs.rand(50_000).astype(np.float32), "b": rs.rand(7).astype(np.float64)}


def template() -> dict:
    return {k: np.zeros_like(v) for k, v in values(0).items()}


def assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def largest_data_file(root) -> str:
    files = [f for f in glob.glob(os.path.join(root, "**", "d", "*"), recursive=True)]
    return max(files, key=os.path.getsize)


def flip(path: str, at: float) -> None:
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.fixture
def two_steps(make_world, tmp_path):
    """Steps 1 and 2 of a small state (numpy values, and a replicated array)."""
    world = make_world(2)
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        for step in (1, 2):
            state = values(step) | {"r": jax.device_put(values(step)["w"][:64], world.replicated)}
            manager.save(step, state=state)
    return tmp_path / "ckpt"


def restore_latest(directory):
    with CheckpointManager(directory) as manager:
        like = template() | {"r": jax.numpy.zeros(64, np.float32)}
        return manager.restore_latest(state=like)


DAMAGE = {
    "flipped byte in array data (early)": lambda d: flip(largest_data_file(d / "2/state"), 0.1),
    "flipped byte in array data (middle)": lambda d: flip(largest_data_file(d / "2/state"), 0.5),
    "flipped byte in array data (end)": lambda d: flip(largest_data_file(d / "2/state"), 0.99),
    "array data cut short": lambda d: truncate(largest_data_file(d / "2/state")),
    "manifest deleted": lambda d: os.remove(d / "2/state/manifest.ocdbt"),
    "array metadata deleted": lambda d: os.remove(d / "2/state/_METADATA"),
    "JSON metadata cut short": lambda d: truncate(d / "2/meta/metadata"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_restore_latest_skips_a_damaged_step(two_steps, damage):
    DAMAGE[damage](two_steps)
    with pytest.warns(FleetWarning, match=r"(?s)checkpoint .*ckpt/2 is damaged: .*; skipped it "
                                          r"\(moved to .*ckpt/2.damaged\)"):
        restored = restore_latest(two_steps)
    assert restored.step == 1
    state = {k: np.asarray(v) for k, v in restored.state.items()}
    assert_bitwise(state, values(1) | {"r": values(1)["w"][:64]})
    assert sorted(os.listdir(two_steps)) == ["1", "2.damaged"]
    with CheckpointManager(two_steps, async_save=False) as manager:  # the job goes on
        assert manager.all_steps() == [1]
        assert manager.save(2, state=values(2) | {"r": jax.numpy.ones(64, np.float32)})


def test_a_flipped_byte_is_named_by_its_array(two_steps):
    flip(largest_data_file(two_steps / "2/state"), 0.5)  # decodes fine, but wrong
    with CheckpointManager(two_steps) as manager, pytest.raises(
            FleetCheckpointError, match=r"(?s)ckpt/2 is damaged: 1 array does not match the checksum "
                                        r"written with it.*\n  state 'w': crc32 0x[0-9a-f]{8} as "
                                        r"read, 0x[0-9a-f]{8} when written"):
        manager.restore(2, state=template() | {"r": jax.numpy.zeros(64, np.float32)})


def test_every_step_damaged_restores_nothing(two_steps):
    for step in (1, 2):
        truncate(largest_data_file(two_steps / f"{step}/state"))
    with pytest.warns(FleetWarning, match="ckpt/2 is damaged"), \
         pytest.warns(FleetWarning, match="ckpt/1 is damaged"), \
         pytest.raises(FleetCheckpointError, match=r"(?s)every checkpoint in .* is damaged \(steps "
                                                   r"\[2, 1\].*nothing was restored"):
        restore_latest(two_steps)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_fleet_load_refuses_damaged_data(tmp_path, damage):
    path = tmp_path / "model.pdparams"
    save(values(1), path)
    assert_bitwise(load(path), values(1))
    (flip if damage == "flip" else truncate)(largest_data_file(path), *([0.5] if damage == "flip"
                                                                        else []))
    match = (r"(?s)model.pdparams is damaged: 1 array does not match the checksum .*\n  "
             r"\['w'\]: crc32" if damage == "flip" else r"model.pdparams is damaged: ")
    with pytest.raises(FleetCheckpointError, match=match):
        load(path)


def test_fleet_load_verifies_a_manager_part(two_steps):
    flip(largest_data_file(two_steps / "2/state"), 0.5)
    with pytest.raises(FleetCheckpointError, match=r"(?s)2/state is damaged: .*\['w'\]: crc32"):
        load(two_steps / "2/state")
    assert_bitwise({k: load(two_steps / "1/state")[k] for k in ("w", "b")}, values(1))


# -- disk full ----------------------------------------------------------------------------------

@pytest.fixture
def enospc_at_commit(monkeypatch):
    """orbax's final rename of a step fails with ENOSPC (what a full disk does)."""
    from orbax.checkpoint._src.path import async_path

    async def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    def arm():
        monkeypatch.setattr(async_path, "rename", full)

    return arm


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_is_reported_and_the_previous_step_stays(make_world, tmp_path, enospc_at_commit,
                                                           async_save):
    make_world(1)
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory, max_to_keep=1, async_save=async_save)
    manager.save(1, state=values(1))
    manager.wait_until_finished()
    enospc_at_commit()
    message = (rf"disk full at {directory}: the checkpoint of step 2 was not written \(its "
               r"temporary files are removed; the steps saved before are intact: \[1\]\)")
    if async_save:
        assert manager.save(2, state=values(2))  # started; fails in the background
        with pytest.raises(FleetCheckpointError, match=message):
            manager.save(3, state=values(3))  # the next call reports it
    else:
        with pytest.raises(FleetCheckpointError, match=message):
            manager.save(2, state=values(2))
    assert manager.all_steps() == [1]
    assert sorted(os.listdir(directory)) == ["1"]  # no temporary directories left
    restored = manager.restore_latest(state=template())
    assert restored.step == 1
    assert_bitwise(restored.state, values(1))
    manager.close()


def test_fleet_save_disk_full_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "model.pdparams"
    save(values(1), path)
    from orbax.checkpoint._src.path import async_path

    async def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(async_path, "rename", full)
    with pytest.raises(FleetCheckpointError, match=rf"fleet.save: disk full at {tmp_path}: "
                                                   r".*model.pdparams was not written \(the "
                                                   r"previous one is unchanged\)"):
        save(values(2), path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["model.pdparams"]
    assert_bitwise(load(path), values(1))


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="cannot mount a tmpfs in a user namespace here")
def test_a_real_full_disk(tmp_path):
    """A 2 MB tmpfs (in a user and mount namespace of the worker alone): step 2
    (4 MB of random floats) does not fit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$@"', str(disk),
         sys.executable, EXIT_WORKER, "tmpfs", str(disk / "ckpt"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=ckpt_jobs._env(1))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert ("save(3) raised: disk full at " + str(disk / "ckpt") + ": the checkpoint of step 2 "
            "was not written") in out, out
    assert "steps [1] files ['1']" in out, out
    assert "restored 1 True" in out, out


# -- the script ends without close() -------------------------------------------------------------

def run_exit_worker(tmp_path, mode):
    proc = subprocess.run([sys.executable, EXIT_WORKER, mode, str(tmp_path / "ckpt"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=ckpt_jobs._env(1))
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("mode, status", [("return", 0), ("raise", 1)])
def test_a_pending_save_completes_at_exit(make_world, tmp_path, mode, status):
    code, out = run_exit_worker(tmp_path, mode)
    assert code == status, out
    assert "saving step 2; ending without close()" in out
    assert "cannot schedule new futures" not in out, out
    if mode == "raise":
        assert "RuntimeError: the training script failed" in out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
    make_world(1)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        for step in (1, 2):
            want = np.load(tmp_path / f"expected-{step}.npy")
            got = manager.restore(step, state={"w": np.zeros_like(want)}).state["w"]
            assert got.tobytes() == want.tobytes()


def test_a_pending_save_that_cannot_complete_fails_the_exit(make_world, tmp_path):
    code, out = run_exit_worker(tmp_path, "disk-full")
    assert code == 1, out
    assert (f"fleet.CheckpointManager: the checkpoint of step 2 in {tmp_path / 'ckpt'} was LOST "
            "at interpreter exit (disk full); the steps saved before are intact. Exiting with "
            "status 1.") in out, out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]  # the half-written step removed
    make_world(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path / "ckpt") as manager:
            assert manager.all_steps() == [1]
            want = np.load(tmp_path / "expected-1.npy")
            got = manager.restore_latest(state={"w": np.zeros_like(want)}).state["w"]
            assert got.tobytes() == want.tobytes()
