"""fleetrun with real processes and real collectives (gloo over 127.0.0.1).

Every job gets a unique ``--job_id``; "no process remains" means no process on
the machine still carries that ``FLEET_JOB_ID`` in its environment.
"""

import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from job_processes import wait_until_gone  # noqa: E402

from tests.jobs import FLEETRUN, free_port  # noqa: E402
from tests.tiers import slow  # noqa: E402

pytestmark = slow  # real launcher jobs: faults, signals, restarts, two nodes


def assert_nothing_left(job):
    assert wait_until_gone(job.job_id, timeout=2) == []


@pytest.fixture(scope="module")
def reference():
    from linear_common import train_reference

    return train_reference()


def assert_same_params(path, reference):
    from linear_common import assert_same_params as same

    same(path, reference)


# -- acceptance 1: the same parameters as the single-card script ---------------------------

@pytest.mark.parametrize("nproc,devices,entry", [
    (2, 2, "fleetrun"),
    (1, 4, "python -m fleet.launch"),
])
def test_trains_like_single_card(jobs, tmp_path, reference, nproc, devices, entry):
    out = tmp_path / "params.npz"
    command = [FLEETRUN] if entry == "fleetrun" else [sys.executable, "-m", "fleet.launch"]
    job = jobs("--print_config", "--nproc_per_node", str(nproc), "--cpu-devices", str(devices),
               str(SCRIPTS / "train_linear.py"), str(out), entry=command)
    assert job.wait(timeout=120) == 0, job.output
    assert_same_params(out, reference)
    text = job.output
    assert "-----------  Configuration Arguments -----------" in text
    assert f"nproc_per_node: {nproc}" in text and f"cpu_devices: {devices}" in text
    assert f"Local start {nproc} processes" in text
    assert re.search(rf"\|\s+PADDLE_TRAINERS_NUM\s+{nproc}\s+\|", text)
    # Worker 0 live on the console as the seed shows it (one rank's lines: no prefix);
    # every worker's log file.
    assert "rank 0's output follows" in text
    assert re.search(r"^step:7\tloss:", text, re.M)
    assert "[rank" not in text
    for rank in range(nproc):
        assert re.search(r"^step:7\tloss:", job.log(rank), re.M)


# -- acceptance 2 and 3: a killed or stopped worker ends the job ---------------------------

LOOP = str(SCRIPTS / "train_loop.py")


def test_kill_9_of_one_worker(jobs):
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1", LOOP)
    for rank in (0, 1):
        job.wait_for_log(rank, r"step:3\t")
    victim = job.pid(1)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = job.wait(timeout=10)
    teardown = time.monotonic() - killed
    text = job.output
    assert code == 128 + 9, text
    assert f"rank 1 (pid {victim}) was killed by signal SIGKILL (9)" in text
    assert re.search(r"last \d+ lines of .*workerlog\.1 \(rank 1\):\n(\[rank 1\] .*\n)*"
                     r"\[rank 1\] step:\d+\tloss:", text)
    assert "job failed: rank 1 was killed by signal SIGKILL (9); exit code 137" in text
    assert_nothing_left(job)
    print(f"teardown after kill -9: {teardown:.2f} s")


@pytest.mark.parametrize("how", ["sigstop", "deadlock"])
def test_stuck_worker_ends_the_job(jobs, how):
    timeout = 3
    args = ["--hang_rank", "1", "--hang_step", "5"] if how == "deadlock" else []
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1",
               "--progress_timeout", str(timeout), LOOP, *args)
    if how == "sigstop":
        job.wait_for_log(1, r"step:3\t")
        os.kill(job.pid(1), signal.SIGSTOP)
    else:
        job.wait_for_log(1, r"rank 1 hangs at step 5")
    stuck = time.monotonic()
    code = job.wait(timeout=timeout + 10)
    elapsed = time.monotonic() - stuck
    text = job.output
    assert code == 124, text
    reason = ("its process has been stopped" if how == "sigstop"
              else r"no progress for .*rank 1 fell silent first")
    assert re.search(rf"rank 1 \(pid \d+\) is stuck: {reason}", text), text
    assert "job failed: rank 1 is stuck; exit code 124" in text
    assert elapsed < timeout + 8
    assert_nothing_left(job)


def test_distributed_step_sends_heartbeats(jobs):
    """No heartbeat() in the script: the stuck worker is found through fleet's own step."""
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1", "--progress_timeout", "3",
               LOOP, "--no_heartbeat", "--hang_rank", "1", "--hang_step", "5")
    job.wait_for_log(1, r"rank 1 hangs at step 5")
    assert job.wait(timeout=3 + 8) == 124, job.output
    assert re.search(r"rank 1 \(pid \d+\) is stuck: no progress", job.output)


# -- acceptance 4: a script that raises -----------------------------------------------------

@pytest.mark.parametrize("arg,code", [("raise", 1), ("7", 7)])
def test_failure_exit_code_and_traceback(jobs, arg, code):
    job = jobs("--nproc_per_node", "2", str(SCRIPTS / "exit_on_rank.py"), arg)
    assert job.wait(timeout=30) == code
    text = job.output
    assert re.search(rf"rank 1 \(pid \d+\) exited with code {code}; stopping the other", text)
    assert "restarting" not in text  # --max_restarts defaults to 0
    if arg == "raise":
        assert re.search(r"\[rank 1\] Traceback \(most recent call last\):\n"
                         r"(\[rank 1\] .*\n)*\[rank 1\] ValueError: boom from rank 1", text)
    assert_nothing_left(job)


@pytest.mark.parametrize("how, code", [
    ("raise", 1), ("sys.exit", 3), pytest.param("SystemExit", 4, marks=slow)])
def test_a_worker_that_fails_mid_training_ends_the_job_at_once(jobs, how, code):
    """Rank 1 of a training job (joined, in collectives with rank 0) raises or
    exits non-zero: it does not wait in JAX's shutdown barrier for rank 0, which
    waits for it in the next step; the launcher names it and its status at once,
    long before the watchdog would. Its traceback starts at the script: fleet's
    runner (fleet/launch/_run.py) leaves its own frames out. sys.exit is never
    replaced (issue 19)."""
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1", "--progress_timeout", "120",
               LOOP, "--raise_rank", "1", "--raise_step", "4", "--exit", how)
    job.wait_for_log(1, rf"rank 1 fails at step 4 \({re.escape(how)}\)")
    failed = time.monotonic()
    assert job.wait(timeout=30) == code, job.output
    elapsed = time.monotonic() - failed
    text = job.output
    print(f"{how}: the job ended {elapsed:.1f} s after rank 1 failed")
    assert re.search(rf"rank 1 \(pid \d+\) exited with code {code}", text), text
    assert elapsed < 15
    if how == "raise":
        assert re.search(r"\[rank 1\] Traceback \(most recent call last\):\n"
                         r"\[rank 1\]   File \".*train_loop.py\", line \d+, in <module>", text), text
        assert "_run.py" not in text and "runpy" not in text
    assert_nothing_left(job)


# -- acceptance 5: restarts -----------------------------------------------------------------

def test_max_restarts(jobs, tmp_path):
    seen = tmp_path / "seen.txt"
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1", "--max_restarts", "1",
               str(SCRIPTS / "fail_once.py"), str(seen))
    assert job.wait(timeout=90) == 0, job.output
    assert sorted(seen.read_text().splitlines()) == [
        "rank 0 restart 0 env 0", "rank 0 restart 1 env 1",
        "rank 1 restart 0 env 0", "rank 1 restart 1 env 1"]
    text = job.output
    assert "rank 1 fails on the first run" in text  # the first run's failure, reported
    assert "restarting all 2 workers (restart 1 of 1)" in text
    assert "----- restart 1 -----" in job.log(1)


# -- signals to the launcher ------------------------------------------------------------------

def test_ctrl_c_stops_jax_workers(jobs, sigint_default):
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1", LOOP)
    for rank in (0, 1):
        job.wait_for_log(rank, r"step:2\t")
    job.proc.send_signal(signal.SIGINT)
    assert job.wait(timeout=15) == 128 + signal.SIGINT
    assert "got SIGINT: stopping all 2 workers" in job.output
    assert_nothing_left(job)


def test_sigterm_stops_stubborn_workers_and_their_children(jobs):
    job = jobs("--nproc_per_node", "2", str(SCRIPTS / "stubborn.py"))
    for rank in (0, 1):
        job.wait_for_log(rank, "ready")
    children = [int(re.search(r"child (\d+)", job.log(r))[1]) for r in (0, 1)]
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=15) == 128 + signal.SIGTERM
    assert_nothing_left(job)
    assert not any(psutil.pid_exists(c) and psutil.Process(c).status() != "zombie"
                   for c in children)


def test_workers_die_with_a_killed_launcher(jobs):
    job = jobs("--nproc_per_node", "2", str(SCRIPTS / "exit_on_rank.py"), "0")
    job.wait_for_log(0, "starts")
    job.proc.kill()  # SIGKILL: no chance to clean up
    job.proc.wait()
    assert_nothing_left(job)


# -- devices ---------------------------------------------------------------------------------

def test_each_gpu_process_sees_only_its_gpu(jobs):
    job = jobs("--gpus", "1,0", str(SCRIPTS / "show_env.py"),
               env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert job.wait(timeout=30) == 0, job.output
    assert "CUDA_VISIBLE_DEVICES=1" in job.log(0) and "CUDA_VISIBLE_DEVICES=0" in job.log(1)
    assert f"FLEET_JOB_ID={job.job_id}" in job.log(1)


def test_workers_see_paddle_3s_variables(jobs):
    """Issue 23: what Paddle 3.3's launcher sets beside the four classic names, with
    its values (PADDLE_MASTER: rank 0's endpoint; PADDLE_LOG_DIR: the absolute
    --log_dir); the launcher's table shows them only with --verbose_env."""
    job = jobs("--nproc_per_node", "2", str(SCRIPTS / "show_env.py"))
    assert job.wait(timeout=30) == 0, job.output
    for rank in (0, 1):
        env = dict(line.split("=", 1) for line in job.log(rank).splitlines()
                   if line.startswith("PADDLE_"))
        endpoints = env["PADDLE_TRAINER_ENDPOINTS"].split(",")
        assert {k: env[k] for k in ("PADDLE_GLOBAL_RANK", "PADDLE_GLOBAL_SIZE",
                                    "PADDLE_LOCAL_RANK", "PADDLE_RANK_IN_NODE",
                                    "PADDLE_LOCAL_SIZE", "PADDLE_NNODES", "PADDLE_MASTER",
                                    "PADDLE_LOG_DIR", "PADDLE_TRAINER_ID")} == {
            "PADDLE_GLOBAL_RANK": str(rank), "PADDLE_GLOBAL_SIZE": "2",
            "PADDLE_LOCAL_RANK": str(rank), "PADDLE_RANK_IN_NODE": str(rank),
            "PADDLE_LOCAL_SIZE": "2", "PADDLE_NNODES": "1", "PADDLE_MASTER": endpoints[0],
            "PADDLE_LOG_DIR": str(job.log_dir.resolve()), "PADDLE_TRAINER_ID": str(rank)}
    assert "PADDLE_GLOBAL_RANK" not in job.output.split("workerlog")[0]  # not in the table


# -- acceptance 6: two nodes -------------------------------------------------------------------

@pytest.mark.parametrize("form", ["master", "ips"])
def test_two_nodes_train_like_one(jobs, tmp_path, reference, form):
    out = tmp_path / "params.npz"
    master = f"127.0.0.1:{free_port()}"
    job_id = f"test-{uuid.uuid4().hex[:10]}"
    nodes = []
    for node in (0, 1):
        where = (["--nnodes", "2", "--master", master] if form == "master"
                 else ["--ips", "127.0.0.1,127.0.0.1", "--master", master])
        nodes.append(jobs(*where, "--node_rank", str(node), "--cpu_devices", "2",
                          str(SCRIPTS / "train_linear.py"), str(out),
                          name=f"node{node}", job_id=job_id))
    for node in nodes:
        assert node.wait(timeout=120) == 0, node.output
    assert_same_params(out, reference)
    for rank, node in enumerate(nodes):  # each node echoes its first worker
        assert f"rank {rank}'s output follows" in node.output
        assert re.search(r"^step:7\tloss:", node.output, re.M)
    # (issue 38: the node's place is in fleetrun's one start line, not Paddle's table)
    assert "on node 1 of 2 (2 processes in the job)" in nodes[1].output, nodes[1].output


# -- the seeds' command lines, as written, two launchers on loopback ---------------------------
# The two "machines" are 127.0.0.1 and 127.0.0.2 (both loopback), with two (fake) GPUs
# each: CUDA_VISIBLE_DEVICES=0,1 lets --selected_gpus / --gpus pass; JAX, without a GPU
# here, runs each process on one CPU device. 4 processes train the reference's steps.

SEED_002 = ["--cluster_node_ips=127.0.0.1,127.0.0.2", "--node_ip={ip}",
            "--started_port={port}", "--selected_gpus=0,1"]
SEED_004 = ["--ips=127.0.0.1,127.0.0.2", "--gpus=0,1"]


def seed_table(gpus, ips, log_dir, script, args):
    return "\n".join([
        "-----------  Configuration Arguments -----------",
        f"gpus: {gpus}", f"ips: {ips}", f"log_dir: {log_dir}", "server_num: None", "servers:",
        f"training_script: {script}", f"training_script_args: {args}", "worker_num: None",
        "workers:"])


@pytest.mark.parametrize("seed", ["002", "004"])
def test_seed_command_lines_on_two_launchers(jobs, tmp_path, reference, seed):
    out = tmp_path / "params.npz"
    port = free_port()
    job_id = f"test-{uuid.uuid4().hex[:10]}"
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0,1", "XLA_FLAGS": "", "FLEETRUN_PRINT_CONFIG": "1"}
    nodes = []
    for node, ip in enumerate(("127.0.0.1", "127.0.0.2")):
        if seed == "002":
            args = [a.format(ip=ip, port=port) for a in SEED_002]
            env = gpu_env
        else:  # one machine plays both: it cannot find itself in --ips, so say which node
            args = SEED_004
            env = {**gpu_env, "FLEETRUN_NODE_RANK": str(node), "FLEETRUN_STARTED_PORT": str(port)}
        nodes.append(jobs(*args, str(SCRIPTS / "train_linear.py"), str(out),
                          name=f"node{node}", job_id=job_id, env=env))
    for node in nodes:
        assert node.wait(timeout=180) == 0, node.output
    assert_same_params(out, reference)
    for node, job in enumerate(nodes):
        text = job.output
        expected = seed_table("0,1", "127.0.0.1,127.0.0.2", job.log_dir,
                              SCRIPTS / "train_linear.py", [str(out)])
        assert text.startswith(expected + "\n"), text
        assert f"node_rank: {node}" in text and f"master: 127.0.0.1:{port}" in text
        # The env table: Paddle's five rows, the seed's order, rank 2 * node first here.
        rows = re.findall(r"^\s+\|\s+(\S+)\s+(\S+)\s*\|$", text, re.M)
        endpoints = ",".join(f"127.0.0.{n}:{port + i}" for n in (1, 2) for i in (0, 1))
        assert rows == [
            ("PADDLE_CURRENT_ENDPOINT", f"127.0.0.{node + 1}:{port}"),
            ("PADDLE_TRAINERS_NUM", "4"),
            ("FLAGS_selected_gpus", "0"),
            ("PADDLE_TRAINER_ENDPOINTS", "..." + endpoints[-42:]),
            ("PADDLE_TRAINER_ID", str(2 * node)),
        ], text
        assert re.search(r"^step:7\tloss:", text, re.M)
        assert f"rank {2 * node + 1} of processes: 4" in job.log(2 * node + 1)
