"""Issue 10: bad input to fleet.checkpoint, one case a line. Each gets a
FleetCheckpointError that says what was given and what to do, and changes
nothing on disk (checked bitwise where something was there).

Multi-process cases (a collective call on one rank only) are in
test_checkpoint_collective.py; faults (damaged files, disk full, exit without
close) in test_checkpoint_faults.py; writers that died or collide in
test_checkpoint_crash.py.
"""

import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager, FleetCheckpointError, load, save

HOST = re.escape(socket.gethostname())


def a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_bytes(b"precious bytes")
    return path


def a_zip_of_other_things(tmp_path):
    path = tmp_path / "arrays.npz"
    np.savez(path, w=np.ones(2))
    return path


def a_directory_of_other_things(tmp_path):
    path = tmp_path / "photos"
    path.mkdir()
    (path / "cat.jpg").write_bytes(b"meow")
    return path


def existing_step(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, state={"w": np.arange(3.0)})
    try:
        manager.save(1, state={"w": np.zeros(3)})
    finally:
        manager.close()


# Another job's CheckpointManager, as it holds its directory: the lock file names
# it, and it holds a flock on the file until it ends (fleet/checkpoint/_lock.py).
HOLD = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": "job-elsewhere",
                         "processes": 1, "since": "2026-11-24 10:00:00", "saving": 3}).encode())
print("locked", flush=True)
time.sleep(60)
"""


def written_by_another_job(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory / ".fleet-lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        CheckpointManager(directory)
    finally:
        holder.kill()
        holder.wait()


def opened_twice(tmp_path):
    with CheckpointManager(tmp_path / "ckpt"):
        CheckpointManager(tmp_path / "ckpt")


CASES = [
    # (what, call, message)
    ("fleet.save onto a regular file",
     lambda p: save({"w": np.ones(2)}, a_file(p)),
     r"fleet.save: .*afile is a file that fleet.save did not write \(not a zip archive\); "
     r"fleet.save replaces only what it wrote: choose another path or remove the file"),
    ("fleet.save onto a zip file of other things",
     lambda p: save({"w": np.ones(2)}, a_zip_of_other_things(p)),
     r"fleet.save: .*arrays.npz is a file that fleet.save did not write \(a zip archive without "
     r"fleet.json\); fleet.save replaces only what it wrote"),
    ("fleet.save onto a directory of other things",
     lambda p: save({"w": np.ones(2)}, a_directory_of_other_things(p)),
     r"fleet.save: .*photos is a directory that is not a checkpoint \(it holds \['cat.jpg'\]\); "
     r"fleet.save replaces only what fleet.save wrote"),
    ("fleet.save of a function",
     lambda p: save({"f": len}, p / "x"),
     r"\['f'\] is a builtin_function_or_method; fleet.save takes dicts and lists of arrays"),
    ("fleet.load of a file of other things",
     lambda p: load(a_file(p)),
     r"fleet.load: .*afile is not a checkpoint written by fleet.save \(not a zip archive\)"),
    ("fleet.load of a zip file of other things",
     lambda p: load(a_zip_of_other_things(p)),
     r"fleet.load: .*arrays.npz is not a checkpoint written by fleet.save \(a zip archive "
     r"without fleet.json\)"),
    ("fleet.load of a directory of other things",
     lambda p: load(a_directory_of_other_things(p)),
     r"fleet.load: .*photos is not a checkpoint written by fleet.save \(a directory without "
     r"_METADATA\)"),
    ("fleet.load of nothing",
     lambda p: load(p / "missing"),
     r"fleet.load: .*missing is not a checkpoint written by fleet.save \(it does not exist\)"),
    ("CheckpointManager on a file",
     lambda p: CheckpointManager(a_file(p)),
     r"CheckpointManager: .*afile is a file, not a directory; a checkpoint manager writes one "
     r"directory per step into a directory: give another path"),
    ("CheckpointManager with max_to_keep=0",
     lambda p: CheckpointManager(p, max_to_keep=0),
     r"max_to_keep must be an int >= 1 or None, got 0"),
    ("CheckpointManager with save_interval_steps=1.5",
     lambda p: CheckpointManager(p, save_interval_steps=1.5),
     r"save_interval_steps must be an int >= 1 or None, got 1.5"),
    ("save of a negative step",
     lambda p: CheckpointManager(p).save(-1, state={}),
     r"step must be an int >= 0, got -1"),
    ("save of a step that is already saved",
     existing_step,
     r"step 1 is already saved in .*ckpt; pass force=True to overwrite it, or save under "
     r"another step number"),
    ("restore of a step never saved",
     lambda p: CheckpointManager(p).restore(5, state={}),
     r"there is no complete checkpoint of step 5 in .*; saved steps: \[\]"),
    # Issue 22, item 3: one writer a directory.
    ("CheckpointManager on a directory another job writes",
     written_by_another_job,
     rf"CheckpointManager: .*/ckpt is being written by another job \(pid \d+ on host {HOST} \(job "
     r"job-elsewhere, since 2026-11-24 10:00:00\)\); a checkpoint directory has one writer at a "
     r"time: wait until that job ends, or give this job another directory"),
    ("CheckpointManager on a directory this process writes already",
     opened_twice,
     rf"CheckpointManager: .*/ckpt is already open in another CheckpointManager of this process "
     rf"\(pid {os.getpid()} on host {HOST} \(since .*\)\); a checkpoint directory has one writer "
     r"at a time: close the other manager first"),
]


def snapshot(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("what, call, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(make_world, tmp_path, what, call, message):
    make_world(1)
    with pytest.raises(FleetCheckpointError, match=message):
        call(tmp_path)


@pytest.mark.parametrize("make", [a_file, a_zip_of_other_things, a_directory_of_other_things])
def test_a_refused_save_changes_nothing(tmp_path, make):
    path = make(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(FleetCheckpointError):
        save({"w": np.ones(2)}, path)
    assert snapshot(tmp_path) == before  # bitwise, and nothing hidden beside it


def test_a_refused_overwrite_keeps_the_step(make_world, tmp_path):
    make_world(1)
    with pytest.raises(FleetCheckpointError, match="already saved"):
        existing_step(tmp_path)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        got = manager.restore(1, state={"w": np.zeros(3)}).state["w"]
    assert got.tobytes() == np.arange(3.0).tobytes()


def test_save_and_restore_take_one_list_of_parts(make_world, tmp_path):
    """Issue 20: save, restore and restore_latest take the parts of one signature
    (fleet.checkpoint._state.Contents): the same keywords, shown by help(), and a
    misspelled one is a TypeError before anything is read or written."""
    import inspect

    make_world(1)
    parts = ["model", "optimizer", "state", "rng", "loader"]
    assert list(inspect.signature(CheckpointManager.save).parameters) == [
        "self", "step", *parts, "epoch", "metadata", "force"]
    assert list(inspect.signature(CheckpointManager.restore).parameters) == ["self", "step", *parts]
    assert list(inspect.signature(CheckpointManager.restore_latest).parameters) == ["self", *parts]
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        for call, args in [("save", (1,)), ("restore", (1,)), ("restore_latest", ())]:
            with pytest.raises(TypeError, match=rf"CheckpointManager.{call}\(\) got an "
                                                r"unexpected keyword argument 'modle'"):
                getattr(manager, call)(*args, modle=np.ones(2))
        assert manager.all_steps() == []


# -- issue 22, item 11: a read-only directory ------------------------------------------------

@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs at ``tmp_path/ro``: the tests run as root, whom no chmod stops."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({mount.stderr.strip()})")
    yield ro
    subprocess.run(["umount", "-l", str(ro)], capture_output=True)


READ_ONLY = [
    # (what, call, message: RO stands for the read-only directory)
    ("CheckpointManager on a read-only directory",
     lambda ro: CheckpointManager(ro),
     r"CheckpointManager: cannot write to RO: it is read-only \(OSError: \[Errno 30\] Read-only "
     r"file system: .*\)\. A checkpoint manager writes its steps and its lock file \(.fleet-lock\) "
     r"there: give a writable directory \(or remount it writable\)\. To read a step of a "
     r"read-only directory, fleet.load reads each of its parts: fleet.load\('RO/<step>/model'\)"),
    ("CheckpointManager creating a directory in a read-only one",
     lambda ro: CheckpointManager(ro / "ckpt"),
     r"CheckpointManager: cannot write to RO \(to create RO/ckpt\): it is read-only \(OSError: "
     r"\[Errno 30\]"),
    ("fleet.save into a read-only directory",
     lambda ro: save({"w": np.ones(2)}, ro / "model.pdparams"),
     r"fleet.save: cannot write RO/model.pdparams: RO is read-only \(OSError: \[Errno 30\] "
     r"Read-only file system: .*\); nothing was written: save to a writable directory"),
    ("fleet.save creating a directory in a read-only one",
     lambda ro: save({"w": np.ones(2)}, ro / "sub" / "model.pdparams"),
     r"fleet.save: cannot write RO/sub/model.pdparams: RO \(to create RO/sub\) is read-only"),
]


@pytest.mark.parametrize("what, call, message", READ_ONLY, ids=[c[0] for c in READ_ONLY])
def test_a_read_only_directory(make_world, read_only_dir, what, call, message):
    make_world(1)
    with pytest.raises(FleetCheckpointError, match=message.replace("RO", re.escape(str(read_only_dir)))):
        call(read_only_dir)
    assert os.listdir(read_only_dir) == []
