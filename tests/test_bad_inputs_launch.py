"""Bad input and faults at the launcher, as one table (issue 10).

Every multi-process case is a real ``fleetrun`` job on loopback that must end by
itself within 60 s, with the message checked. Each row: what the user does, the
exit code, the message (a regular expression over the launcher's output), and the
time limit.
"""

import re
import sys
import time
from pathlib import Path

import pytest

from tests.tiers import slow

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import spawn_targets  # noqa: E402
from job_processes import job_processes  # noqa: E402

import fleet  # noqa: E402
from fleet.launch import LaunchConfig, resolve, spawn  # noqa: E402
from fleet.launch._devices import PROCESSES_PER_CORE, cpu_cores  # noqa: E402

LOOP = str(SCRIPTS / "train_loop.py")
ONE_RANK_COLLECTIVE = str(SCRIPTS / "collective_on_one_rank.py")
TWO = ("--nproc_per_node", "2", "--cpu_devices", "1")

# name: (fleetrun arguments, exit code, message(s), seconds)
JOBS = {
    # Uneven data: rank 0 runs 6 steps, rank 1 runs 5 and exits 0. Default settings.
    # The job's last line names both counts too (issue 22).
    "uneven steps, rank 0 one more": (
        (*TWO, LOOP, "--steps", "5", "--extra_step_rank", "0", "--no_heartbeat"), 124,
        (r"rank 0 \(pid \d+\) is stuck: uneven steps: rank 0 ran more steps \(6\) than "
         r"rank 1 \(5\)\. Rank 1 finished after 5 steps",
         r"\n.*job failed: rank 0 is stuck in its step 6, in a collective that rank 1 never "
         r"joins: rank 1 ended after 5 steps \(uneven steps\); exit code 124\n?\Z"), 60),
    # The same with the wait set to seconds (--uneven_grace).
    "uneven steps, rank 1 one more": (
        (*TWO, "--uneven_grace", "2", LOOP, "--steps", "4", "--extra_step_rank", "1",
         "--no_heartbeat"), 124,
        r"rank 1 \(pid \d+\) is stuck: uneven steps: rank 1 ran more steps \(5\) than "
        r"rank 0 \(4\)", 60),
    # Rank 1 finished cleanly; rank 0 hangs after its last step: rank 0 is the one stuck.
    "a rank that exited 0 is never blamed": (
        (*TWO, "--progress_timeout", "5", LOOP, "--steps", "3", "--hang_rank", "0",
         "--hang_step", "3"), 124,
        r"rank 0 \(pid \d+\) is stuck: no progress for .*rank 1: finished", 60),
    # A collective call on rank 0 only, before any step: no heartbeat from anyone.
    # (The first step's floor is 30 s by default; --first_step_min sets it to 3.)
    "stuck before the first step": (
        (*TWO, "--progress_timeout", "3", "--first_step_min", "3", ONE_RANK_COLLECTIVE), 124,
        r"is stuck: no step started within 3 s of the start .* stuck before the first "
        r"step", 60),
}


@slow
@pytest.mark.parametrize("case", list(JOBS))
def test_job_ends_by_itself(jobs, case):
    args, code, message, seconds = JOBS[case]
    job = jobs(*args)
    assert job.wait(timeout=seconds + 30) == code, job.output
    elapsed = time.monotonic() - job.started
    for pattern in (message,) if isinstance(message, str) else message:
        assert re.search(pattern, job.output), job.output
    assert elapsed < seconds, f"{case}: the job ended after {elapsed:.1f} s"
    print(f"{case}: ended after {elapsed:.1f} s")


def test_too_many_processes_are_refused_before_any_starts(jobs, script):
    """Issue 22: --nproc_per_node 5000 on a 2-core machine started 339 processes
    before it was stopped. Beyond 8 CPU processes per core fleetrun refuses, saying
    what was asked and what the machine has, and starts nothing."""
    cores = cpu_cores()
    limit = PROCESSES_PER_CORE * cores
    asked = max(5000, limit + 1)
    job = jobs("--nproc_per_node", str(asked), "--cpu_devices", "1", script)
    assert job.wait(timeout=60) == 2, job.output
    assert (f"fleetrun: error: --nproc_per_node {asked} asks for {asked} CPU processes but "
            f"this machine has {cores} CPU core(s); at most {limit} (8 per core) start "
            "without --allow_oversubscribe") in job.output
    assert "output follows" not in job.output and not job.log_dir.exists()  # nothing started
    assert job_processes(job.job_id) == []
    # Forced, the count passes the checks (nothing is started here).
    config = resolve(LaunchConfig(training_script=script, nproc_per_node=limit + 1,
                                  cpu_devices=1, allow_oversubscribe=True))
    assert config.nproc_per_node == limit + 1


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


# name: (call, error, message)
CALLS = {
    "spawn a lambda": (lambda: spawn(lambda: 1, nprocs=2), fleet.FleetTypeError,
                       r"fleet.spawn cannot send '.*<lambda>' to the new processes: it is a "
                       r"lambda .*defined at the top level"),
    "spawn a local function": (lambda: spawn(_local(), nprocs=2), fleet.FleetTypeError,
                               r"'_local.<locals>.f'.* it is a local function"),
    "spawn an argument that does not pickle": (
        lambda: spawn(spawn_targets.rank, args=(lambda: 0,), nprocs=2), fleet.FleetTypeError,
        r"cannot send args=.*pass values that pickle"),
    "spawn something not callable": (lambda: spawn("train.py", nprocs=2),
                                     fleet.FleetTypeError, r"needs a function, got str"),
    "spawn far more processes than the cores": (
        lambda: spawn(spawn_targets.rank, nprocs=10**5, cpu_devices=1), fleet.FleetConfigError,
        r"--nproc_per_node 100000 asks for 100000 CPU processes but this machine has \d+ "
        r"CPU core\(s\).*allow_oversubscribe=True"),
}


def _local():
    def f():
        return 1
    return f


@pytest.mark.parametrize("case", list(CALLS))
def test_call_raises(case):
    call, error, message = CALLS[case]
    with pytest.raises(error, match=message):
        call()
