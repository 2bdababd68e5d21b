"""Issue 38's faults at the start of a job, rows 6-9, and the checkpoint lock of
another host. Each ends in a fleet error that names what was wrong and what to do:

* row 6: ``PADDLE_TRAINER_ID=abc`` names ``PADDLE_TRAINER_ID``, not ``FLEET_RANK``;
* row 7: ``fleetrun --log_dir`` on a read-only file system: exit code 2 and a
  ``fleetrun: error:`` line, before any worker starts (was a raw ``OSError``);
* row 8: ``fleet.spawn`` from a script without the ``__main__`` guard: refused before
  any process starts (was "process 0 exited with code 1");
* row 9: a worker whose job variables point at a coordinator that is gone: a
  ``FleetConfigError`` at the join timeout naming the address and its variables
  (was JAX's C++ abort after 300 s, exit code 134);
* a stale checkpoint lock that names another host is refused unless
  ``FLEET_CHECKPOINT_TAKE_OVER`` allows it.

Rows 7, 8 and 9 run real processes, each with a deadline.
"""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleet import FleetConfigError, FleetWarning
from fleet.checkpoint import CheckpointManager
from fleet.checkpoint import _lock as lock_module
from fleet.checkpoint._errors import FleetCheckpointError
from fleet.runtime import _coordinator, _heartbeat
from fleet.runtime._env import WorkerEnv, coordinator_source
from tests import tiers
from tests.jobs import FLEETRUN, clean_environ, free_port
from tests.test_bad_inputs_checkpoint import read_only_dir  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"


def _env(**extra: str) -> dict[str, str]:
    """A clean environment whose Python imports this checkout of fleet."""
    return clean_environ(PYTHONPATH=os.pathsep.join([str(REPO), str(SCRIPTS)]),
                         JAX_PLATFORMS="cpu", **extra)


# -- row 6: a Paddle variable that is not an integer ------------------------------------


@pytest.mark.parametrize("paddle, fleet_name", [("PADDLE_TRAINER_ID", "FLEET_RANK"),
                                                ("PADDLE_TRAINERS_NUM", "FLEET_WORLD_SIZE")])
def test_a_paddle_variable_is_named_as_given(paddle, fleet_name):
    with pytest.raises(FleetConfigError,
                       match=rf"^environment variable {paddle}='abc' \(Paddle's name for "
                             rf"{fleet_name}\) is not an integer; .*unset it or give an "
                             r"integer$") as raised:
        WorkerEnv.from_environ({paddle: "abc"})
    assert f"{fleet_name}=" not in str(raised.value)  # never set: not named as if it were
    # fleet's own name, when set, is the one read and the one named
    with pytest.raises(FleetConfigError, match=rf"^environment variable {fleet_name}='x' is"):
        WorkerEnv.from_environ({fleet_name: "x", paddle: "abc"})


# -- row 7: --log_dir on a read-only file system -----------------------------------------


@pytest.mark.parametrize("sub", ["", pytest.param("log", marks=tiers.slow)],
                         ids=["the directory", "a directory in it"])
def test_a_read_only_log_dir_is_refused_before_any_start(read_only_dir, tmp_path, sub):  # noqa: F811
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    log_dir = read_only_dir / sub if sub else read_only_dir
    run = subprocess.run([FLEETRUN, "--log_dir", str(log_dir), str(script)], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=60)
    where = (re.escape(str(read_only_dir)) +
             (rf" \(to create {re.escape(str(log_dir))}\)" if sub else ""))
    assert run.returncode == 2, run.stderr
    assert re.search(rf"^fleetrun: error: --log_dir '{re.escape(str(log_dir))}': cannot write "
                     rf"to {where}: it is read-only \(\[Errno 30\] Read-only file system\)\. "
                     r"fleetrun writes each worker's output there \(workerlog.RANK\) before it "
                     r"starts them: give a writable directory with --log_dir DIR \(or "
                     r"FLEETRUN_LOG_DIR=DIR\)", run.stderr, re.M), run.stderr
    assert "Traceback" not in run.stderr and "trained" not in run.stdout  # nothing started
    assert os.listdir(read_only_dir) == []


# -- row 8: fleet.spawn outside the __main__ guard ----------------------------------------

SPAWNING = """\
import os
import fleet
import spawn_targets

if __name__ != "__main__" and os.environ.get("BREAK_CHILD"):
    raise RuntimeError("this process's import of the script fails")
{call}
"""


def _spawn_script(tmp_path: Path, guarded: bool) -> Path:
    call = "print(fleet.spawn(spawn_targets.rank, nprocs=2, cpu_devices=1).return_values)"
    path = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    path.write_text(SPAWNING.format(
        call=f'if __name__ == "__main__":\n    {call}' if guarded else call))
    return path


def test_spawn_without_the_main_guard_names_the_line(tmp_path):
    script = _spawn_script(tmp_path, guarded=False)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert re.search(
        rf"FleetConfigError: fleet.spawn\(nprocs=2\) is called from line 7 of "
        rf"{re.escape(str(script))}, outside an `if __name__ == \"__main__\":` block\. Its "
        r"processes start with spawn, which imports the script again in each of them.*Put "
        r"the call under the guard", run.stderr), run.stderr
    assert "exited with code" not in run.stderr and "bootstrapping" not in run.stderr
    # The guard in place, the same call runs: one rank per process.
    run = subprocess.run([sys.executable, str(_spawn_script(tmp_path, guarded=True))],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[0, 1]", run.stderr


@tiers.slow
def test_a_process_that_dies_while_starting_is_said_so(tmp_path):
    """Whatever else makes the spawned processes' import of the script fail (the guard
    is there), the parent says they ended before they called the function."""
    script = _spawn_script(tmp_path, guarded=True)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                         env=_env(BREAK_CHILD="1"), capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert re.search(
        r"WorkerFailedError: fleet.spawn: process \d \(pid \d+\) exited with code 1; the other "
        r"processes were stopped \(it ended before it called the function: it failed while "
        rf"starting, e.g. in the import of the main script {re.escape(str(script))}",
        run.stderr), run.stderr
    assert "this process's import of the script fails" in run.stderr  # the child's own cause


# -- row 9: a stale environment: the coordinator is gone ----------------------------------


def test_a_stale_environment_ends_at_the_join_timeout_naming_the_coordinator(tmp_path):
    port = free_port()  # nothing listens there: a closed loopback port
    address = f"127.0.0.1:{port}"
    env = _env(FLEET_RANK="1", FLEET_WORLD_SIZE="2", FLEET_COORDINATOR=address,
               PADDLE_TRAINER_ID="1", PADDLE_TRAINERS_NUM="2", PADDLE_MASTER=address,
               FLEET_JAX_INIT_TIMEOUT="3")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", "import fleet; fleet.init(is_collective=True)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - started
    print(f"stale environment: ended after {seconds:.1f} s (join timeout 3 s)")
    assert run.returncode == 1, run.stderr  # not 134 (JAX's abort)
    assert re.search(
        rf"FleetConfigError: rank 1 of 2: nothing answers at the coordinator's address "
        rf"{address} \(PADDLE_MASTER / FLEET_COORDINATOR, from the environment\) after 3 s "
        r"\(FLEET_JAX_INIT_TIMEOUT; last try: connection refused\)\. .*is this a stale "
        r"environment from an earlier job\? Unset the job's variables .*or start the job "
        r"through fleetrun / fleet.spawn", run.stderr), run.stderr
    assert "DEADLINE_EXCEEDED" not in run.stderr and "RegisterTask" not in run.stderr
    assert seconds < 30


@tiers.slow
def test_the_coordinator_may_start_late(tmp_path):
    """A healthy job: process 0 listens a second after the others knock; they wait."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    timer = threading.Timer(1.0, listener.listen)
    timer.start()
    try:
        waited = _coordinator.wait_for_coordinator(
            WorkerEnv(rank=1, world_size=2, coordinator=address, launcher="fleet"), 20,
            environ={"FLEET_COORDINATOR": address})
    finally:
        timer.join()
        listener.close()
    assert 0.9 < waited < 10


def test_process_0_does_not_knock():
    """Process 0 starts the coordinator itself: it never waits for it."""
    address = f"127.0.0.1:{free_port()}"
    env = WorkerEnv(rank=0, world_size=2, coordinator=address, launcher="fleet")
    assert _coordinator.wait_for_coordinator(env, 0.1, environ={}) == 0.0


@tiers.slow
def test_a_launched_job_whose_process_0_is_gone_points_at_its_log(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    environ = {"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS": f"{address},127.0.0.1:1",
               _heartbeat.ENV: _heartbeat.file_for(str(tmp_path), 1)}
    env = WorkerEnv.from_environ(environ)
    assert coordinator_source(environ) == "PADDLE_TRAINER_ENDPOINTS"
    with pytest.raises(FleetConfigError, match=rf"rank 1 of 2: nothing answers at the "
                       rf"coordinator's address {address} \(PADDLE_TRAINER_ENDPOINTS, from "
                       r"the environment\) after 0.5 s .*Process 0 of the job starts the "
                       r"coordinator there: it failed, or is stopped, before it did; its log "
                       r"\(workerlog.0"):
        _coordinator.wait_for_coordinator(env, 0.5, environ=environ)


# -- the checkpoint lock of another host --------------------------------------------------


def _stale_lock_of(ckpt: Path, host: str) -> dict:
    dead = subprocess.Popen(["true"])
    dead.wait()
    holder = {"host": host, "pid": dead.pid, "job": "job-before", "processes": 1,
              "since": "2026-11-24 09:00:00", "saving": None}
    ckpt.mkdir()
    (ckpt / ".fleet-lock").write_text(json.dumps(holder))
    return holder


@pytest.mark.parametrize("take_over", [None, "node8"], ids=["unset", "another host named"])
def test_a_stale_lock_of_another_host_is_refused(make_world, tmp_path, monkeypatch, take_over):
    make_world(1)
    ckpt = tmp_path / "ckpt"
    holder = _stale_lock_of(ckpt, "node7")
    if take_over is None:
        monkeypatch.delenv("FLEET_CHECKPOINT_TAKE_OVER", raising=False)
    else:
        monkeypatch.setenv("FLEET_CHECKPOINT_TAKE_OVER", take_over)
    lock_file = re.escape(str(ckpt / ".fleet-lock"))
    with pytest.raises(FleetCheckpointError, match=(
            rf"CheckpointManager: {re.escape(str(ckpt))} is locked by pid {holder['pid']} on "
            rf"host node7 \(job job-before, since 2026-11-24 09:00:00\), another host than "
            rf"this one \({re.escape(socket.gethostname())}\).*lock file {lock_file}.*If pid "
            rf"{holder['pid']} no longer runs on node7 .*set FLEET_CHECKPOINT_TAKE_OVER=node7 "
            r"\(or FLEET_CHECKPOINT_TAKE_OVER=1 for any host\).*or delete the lock file")):
        CheckpointManager(ckpt, async_save=False)
    assert json.loads((ckpt / ".fleet-lock").read_text()) == holder  # left as it was


@pytest.mark.parametrize("take_over", ["node7", "1"])
def test_a_stale_lock_of_another_host_is_taken_over_when_allowed(make_world, tmp_path,
                                                                  monkeypatch, take_over):
    make_world(1)
    ckpt = tmp_path / "ckpt"
    holder = _stale_lock_of(ckpt, "node7")
    monkeypatch.setenv("FLEET_CHECKPOINT_TAKE_OVER", take_over)
    with pytest.warns(FleetWarning, match=rf"was left locked by pid {holder['pid']} on host "
                                          r"node7 .*takes the directory over"):
        manager = CheckpointManager(ckpt, async_save=False)
    with manager:
        now = json.loads((ckpt / ".fleet-lock").read_text())
        assert (now["host"], now["pid"]) == (socket.gethostname(), os.getpid())
        assert manager.save(1, state={"w": np.ones(3)})
        assert manager.all_steps() == [1]


def test_without_flock_another_hosts_lock_is_refused_the_same_way(tmp_path, monkeypatch):
    """A file system with no flock at all (ENOLCK): another host's writer may live."""
    def no_flock(fd):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module, "_flock", no_flock)
    holder = _stale_lock_of(tmp_path / "ckpt", "node7")
    with pytest.raises(lock_module.OtherHost) as raised:
        lock_module.take(str(tmp_path / "ckpt"), None, 1)
    assert (raised.value.holder.host, raised.value.holder.pid) == ("node7", holder["pid"])
    lock, old = lock_module.take(str(tmp_path / "ckpt"), None, 1, lambda h: h.host == "node7")
    lock.release()
    assert old.host == "node7"
