"""fleet.spawn: real child processes (spawn start method), real collectives."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest

from fleet import FleetConfigError
from fleet.launch import WorkerFailedError, spawn
from tests.tiers import slow

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # spawned children get the parent's sys.path

import spawn_targets  # noqa: E402
from job_processes import wait_until_gone  # noqa: E402


def _children(exclude):
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.pid not in exclude and p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())):
                found.append(p)  # (multiprocessing's resource tracker lives on by design)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def no_leftovers():
    """Fails if a test leaves a child of this process behind."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    while (left := _children(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:
        p.kill()
    assert not left, f"spawned processes remain: {left}"


@slow
def test_trains_like_single_card_and_returns_values(no_leftovers):
    from linear_common import train_reference

    context = spawn(spawn_targets.train, nprocs=2, cpu_devices=2)
    reference = train_reference()
    assert len(context.return_values) == 2
    for params in context.return_values:  # every process returns its replica's parameters
        assert sorted(params) == sorted(reference)
        for key in reference:
            np.testing.assert_allclose(params[key], reference[key], atol=1e-5, rtol=0)
    assert [p.exitcode for p in context.processes] == [0, 0]


def test_environment_contract_without_join(no_leftovers):
    context = spawn(spawn_targets.describe, args=("hello",), nprocs=2, join=False,
                    cpu_devices=1, job_id="spawned")
    while not context.join(timeout=30):
        pass
    first, second = context.return_values
    assert (first["tag"], first["rank"], second["rank"], first["count"]) == ("hello", 0, 1, 2)
    assert first["devices"] == 1 and first["env"]["JAX_PLATFORMS"] == "cpu"
    env = second["env"]
    assert env["PADDLE_TRAINER_ID"] == "1" and env["PADDLE_TRAINERS_NUM"] == "2"
    assert env["FLEET_JOB_ID"] == "spawned" and env["FLEET_COORDINATOR"].startswith("127.0.0.1:")
    assert env["PADDLE_TRAINER_ENDPOINTS"].split(",")[1] == env["PADDLE_CURRENT_ENDPOINT"]


@slow
@pytest.mark.parametrize("how,match", [
    ("raise", r"process 1 \(pid \d+\) raised an exception; the other processes were "
              r"stopped. Its traceback:\n\nTraceback \(most recent call last\):\n(.*\n)*"
              r"ValueError: boom from spawned rank 1"),
    ("exit", r"process 1 \(pid \d+\) raised an exception(.*\n)*SystemExit: 5"),
    ("sigkill", r"process 1 \(pid \d+\) was killed by signal SIGKILL \(9\); the other "
                r"processes were stopped"),
    ("sigstop", r"process 1 \(pid \d+\) is stuck: its process has been stopped"),
    ("unpicklable", r"the return value of 'fail_on_rank_1' could not be sent to the parent"),
])
def test_first_failure_stops_the_rest_and_raises(no_leftovers, how, match):
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match=match) as failed:
        spawn(spawn_targets.fail_on_rank_1, args=(how,), nprocs=2, progress_timeout=1)
    assert failed.value.rank == 1
    assert failed.value.exitcode == {"sigkill": 137, "sigstop": 124, "exit": 5}.get(how, 1)
    assert time.monotonic() - started < 20  # rank 0 sleeps 60 s: it was stopped


def test_unknown_option_lists_valid_ones():
    with pytest.raises(FleetConfigError, match=r"unknown option\(s\) 'gpu' \(did you mean "
                                               r"'gpus'\?\); valid options: "
                                               r"allow_oversubscribe, cpu_devices, "
                                               r"first_step_min, gpus, job_id, master"):
        spawn(spawn_targets.rank, nprocs=2, gpu="0")


@pytest.mark.parametrize("nprocs", [0, -2, 1.5, "2"])
def test_bad_nprocs(nprocs):
    with pytest.raises(FleetConfigError, match=r"nprocs=.* must be a positive integer"):
        spawn(spawn_targets.rank, nprocs=nprocs)


def test_bad_gpus_fail_before_start(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(FleetConfigError, match=r"GPU id\(s\) 3 do not exist"):
        spawn(spawn_targets.rank, nprocs=1, gpus="3")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


@slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_children_end_with_their_parent(tmp_path, signum, sigint_default):
    """Ctrl-C in the parent stops the children; a parent killed outright takes them along."""
    job_id = f"test-{uuid.uuid4().hex[:10]}"
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        parent = subprocess.Popen([sys.executable, str(SCRIPTS / "spawn_parent.py"), job_id],
                                  stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while out.read_text().count("ready") < 2:
            assert parent.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        parent.send_signal(signum)
        parent.wait(timeout=10)
        if signum == signal.SIGINT:
            assert "KeyboardInterrupt" in out.read_text()
        assert wait_until_gone(job_id) == []
    finally:
        parent.kill()
        parent.wait()
        for p in wait_until_gone(job_id, timeout=0):
            p.kill()


@slow
def test_an_exception_after_joining_the_job_reaches_the_parent(no_leftovers):
    """Issue 22, item 13: a child that joined the job (fleet.init) and raises
    KeyError: its type, message and traceback are in the parent's error."""
    with pytest.raises(WorkerFailedError, match=r"process 1 \(pid \d+\) raised an exception; "
                                                r"the other processes were stopped\. Its "
                                                r"traceback:(.*\n)*KeyError: 'boom in rank 1'"):
        spawn(spawn_targets.key_error_after_init, nprocs=2, progress_timeout=30)
