"""The launcher's stages on their own: arguments -> config -> worker environments,
bad input rejected before any worker starts, the watchdog's signals, the tables."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from fleet import FleetConfigError
from fleet.launch import LaunchConfig, main, parse_args, plan_workers, resolve
from fleet.launch._args import OPTIONS, env_name
from fleet.launch._failure import Failure
from fleet.launch._tables import config_table, env_table, quiet_line
from fleet.launch._watchdog import Watchdog, Watched, process_state
from fleet.launch._worker_plan import worker_base_environ
from fleet.runtime._env import WorkerEnv

NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


# -- arguments ------------------------------------------------------------------------

VALUES = {"nproc_per_node": "3", "gpus": "0,1", "cpu_devices": "2", "nnodes": "2",
          "node_rank": "1", "master": "10.0.0.1:6070", "ips": "10.0.0.1,10.0.0.2",
          "log_dir": "mylogs", "max_restarts": "4", "job_id": "exp7",
          "progress_timeout": "12.5", "node_ip": "10.0.0.2", "started_port": "6170",
          "first_step_min": "4", "uneven_grace": "1.5", "silence_warning": "7.5",
          "verbose_env": None,  # None: an on/off flag (its variable: 1)
          "allow_oversubscribe": None, "join_timeout": "45", "print_config": None}
PARSED = {"nproc_per_node": 3, "gpus": ("0", "1"), "cpu_devices": 2, "nnodes": 2,
          "node_rank": 1, "master": "10.0.0.1:6070", "ips": ("10.0.0.1", "10.0.0.2"),
          "log_dir": "mylogs", "max_restarts": 4, "job_id": "exp7", "progress_timeout": 12.5,
          "node_ip": "10.0.0.2", "started_port": 6170, "first_step_min": 4.0,
          "uneven_grace": 1.5, "silence_warning": 7.5, "verbose_env": True,
          "allow_oversubscribe": True, "join_timeout": 45.0, "print_config": True}


def test_every_option_is_tested():
    assert set(VALUES) == set(OPTIONS) == set(PARSED)


@pytest.mark.parametrize("name", sorted(VALUES))
@pytest.mark.parametrize("spelling", ["underscore", "dash", "env"])
def test_each_option_three_ways(name, spelling):
    value = VALUES[name]
    if spelling == "env":
        config = parse_args(["train.py"], environ={env_name(name): value or "1"})
    else:
        flag = name if spelling == "underscore" else name.replace("_", "-")
        config = parse_args([f"--{flag}", *([value] if value else []), "train.py"], environ={})
    assert getattr(config, name) == PARSED[name]


def test_defaults_and_script_arguments():
    config = parse_args(["train.py", "--lr", "0.1", "--nnodes", "9"], environ={})
    assert config == LaunchConfig(training_script="train.py",
                                  training_script_args=("--lr", "0.1", "--nnodes", "9"))
    assert (config.log_dir, config.max_restarts, config.job_id) == ("log", 0, "default")


def test_command_line_wins_over_environment():
    config = parse_args(["--nnodes", "3", "train.py"], environ={"FLEETRUN_NNODES": "5"})
    assert config.nnodes == 3


@pytest.mark.parametrize("alias", ["--devices", "--selected_gpus", "--selected-gpus"])
def test_gpu_aliases(alias):
    assert parse_args([alias, "2,3", "train.py"], environ={}).gpus == ("2", "3")


def test_paddle_older_spellings():
    """Seed 002's command line: --cluster_node_ips, --node_ip, --started_port."""
    config = parse_args(["--cluster_node_ips=192.168.1.2,192.168.1.3", "--node_ip=192.168.1.3",
                         "--started_port=6170", "--selected_gpus=0,1,2,3", "train.py"],
                        environ={})
    assert (config.ips, config.node_ip, config.started_port, config.gpus) == (
        ("192.168.1.2", "192.168.1.3"), "192.168.1.3", 6170, ("0", "1", "2", "3"))
    assert parse_args(["--verbose_env", "train.py"], environ={}).verbose_env is True
    assert parse_args(["train.py"], environ={"FLEETRUN_VERBOSE_ENV": "0"}).verbose_env is False
    with pytest.raises(FleetConfigError, match=r"FLEETRUN_VERBOSE_ENV='maybe' is not 1 or 0"):
        parse_args(["train.py"], environ={"FLEETRUN_VERBOSE_ENV": "maybe"})


def test_resolve_node_ip_and_started_port(script, tmp_path):
    config = resolve(LaunchConfig(training_script=script, ips=("10.9.9.1", "10.9.9.2"),
                                  node_ip="10.9.9.2", started_port=6170), NO_GPUS)
    assert (config.nnodes, config.node_rank, config.master) == (2, 1, "10.9.9.1:6170")
    envs = [WorkerEnv.from_environ(s.environ) for s in plan_workers(config, 0, str(tmp_path))]
    assert [e.current_endpoint for e in envs] == ["10.9.9.2:6170"]
    assert envs[0].trainer_endpoints == ("10.9.9.1:6170", "10.9.9.2:6170")
    # One node: --started_port fixes the coordinator's port on loopback.
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    config = resolve(LaunchConfig(training_script=script, started_port=free), NO_GPUS)
    assert (config.nnodes, config.master) == (1, f"127.0.0.1:{free}")


def test_bad_environment_value_names_the_variable():
    with pytest.raises(FleetConfigError, match=r"FLEETRUN_NNODES='two' is not an integer"):
        parse_args(["train.py"], environ={"FLEETRUN_NNODES": "two"})


# -- resolution: defaults and bad input ---------------------------------------------------

def test_resolve_single_node_cpu(script):
    config = resolve(LaunchConfig(training_script=script, cpu_devices=2), NO_GPUS)
    assert (config.nproc_per_node, config.nnodes, config.node_rank) == (1, 1, 0)
    assert config.master is None and config.gpus is None


def test_resolve_defaults_to_one_process_per_visible_gpu(script):
    config = resolve(LaunchConfig(training_script=script), {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert (config.nproc_per_node, config.gpus) == (2, ("4", "6"))
    config = resolve(LaunchConfig(training_script=script), NO_GPUS)
    assert (config.nproc_per_node, config.gpus) == (1, None)


def test_resolve_ips_gives_nodes_and_master(script):
    config = resolve(LaunchConfig(training_script=script, ips=("10.9.9.1", "10.9.9.2"),
                                  node_rank=1), NO_GPUS)
    assert (config.nnodes, config.node_rank, config.master) == (2, 1, "10.9.9.1:6070")


def test_resolve_ips_finds_this_machine(script):
    config = resolve(LaunchConfig(training_script=script, ips=("10.9.9.1", "127.0.0.1")),
                     NO_GPUS)
    assert config.node_rank == 1


BAD = [
    (dict(training_script="missing.py"), r"training script 'missing.py' does not exist"),
    (dict(gpus=("0", "7")), r"GPU id\(s\) 7 do not exist; visible GPUs \(from "
                            r"CUDA_VISIBLE_DEVICES='0,1'\): 0,1"),
    (dict(gpus=("0",), cpu_devices=2), r"--gpus and --cpu_devices both given"),
    (dict(gpus=("0", "0")), r"names a GPU twice"),
    (dict(gpus=("0", "1"), nproc_per_node=3), r"--nproc_per_node 3 does not match --gpus 0,1"),
    (dict(nproc_per_node=3), r"--nproc_per_node 3 needs 3 GPUs .* but 2 are visible"),
    (dict(nnodes=2, node_rank=2, master="127.0.0.1:1"),
     r"--node_rank 2 is outside --nnodes 2 \(allowed: 0..1\)"),
    (dict(node_rank=-1), r"--node_rank -1 is outside --nnodes 1"),
    (dict(nnodes=2), r"a 2-node job needs the coordinator's address.*--master HOST:PORT"),
    (dict(ips=("10.9.9.1", "10.9.9.2"), nnodes=3), r"--nnodes 3 does not match --ips"),
    (dict(ips=("10.9.9.1", "10.9.9.2")), r"none of --ips 10.9.9.1,10.9.9.2 is an address "
                                         r"of this machine.*--node_rank"),
    (dict(ips=("127.0.0.1", "127.0.0.1")), r"lists this machine more than once"),
    (dict(master="nohost"), r"--master='nohost' is not host:port"),
    (dict(nproc_per_node=0, cpu_devices=1), r"--nproc_per_node 0 must be at least 1"),
    (dict(cpu_devices=0), r"--cpu_devices 0 must be at least 1"),
    (dict(max_restarts=-1, cpu_devices=1), r"--max_restarts -1 must be at least 0"),
    (dict(progress_timeout=-1.0, cpu_devices=1), r"--progress_timeout -1.0 must be >= 0"),
    (dict(first_step_min=0.0, cpu_devices=1), r"--first_step_min 0.0 must be > 0 seconds"),
    (dict(uneven_grace=-2.0, cpu_devices=1), r"--uneven_grace -2.0 must be > 0 seconds"),
    (dict(silence_warning=-1.0, cpu_devices=1), r"--silence_warning -1.0 must be >= 0"),
    (dict(join_timeout=0.0, cpu_devices=1), r"--join_timeout 0.0 must be > 0 seconds"),
    (dict(nproc_per_node=100000, cpu_devices=1),  # issue 22: far beyond the machine's cores
     r"--nproc_per_node 100000 asks for 100000 CPU processes but this machine has \d+ CPU "
     r"core\(s\); at most \d+ \(8 per core\) start without --allow_oversubscribe"),
    (dict(ips=("10.9.9.1", "10.9.9.2"), node_ip="10.9.9.3"),
     r"--node_ip 10.9.9.3 is not in --ips 10.9.9.1,10.9.9.2"),
    (dict(ips=("10.9.9.1", "10.9.9.1"), node_ip="10.9.9.1"),
     r"--node_ip 10.9.9.1 appears 2 times in --ips .*--node_rank"),
    (dict(ips=("10.9.9.1", "10.9.9.2"), node_ip="10.9.9.2", node_rank=0),
     r"--node_rank 0 and --node_ip 10.9.9.2 disagree"),
    (dict(log_dir=__file__, cpu_devices=1),  # issue 22: a file, not a directory
     r"--log_dir '.*test_launch_config.py' is a file; the workers' logs \(workerlog.N\) go "
     r"in a directory"),
    (dict(started_port=70000), r"--started_port 70000 must be a port"),
    (dict(started_port=6170, master="127.0.0.1:6170"),
     r"--started_port 6170 and --master 127.0.0.1:6170 both give the coordinator's port"),
]


@pytest.mark.parametrize("fields,match", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_fails_before_start(script, fields, match):
    fields = {"training_script": script, **fields}
    with pytest.raises(FleetConfigError, match=match):
        resolve(LaunchConfig(**fields), {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_gpu_ids_on_a_machine_without_gpus(script):
    with pytest.raises(FleetConfigError, match=r"GPU id\(s\) 0 do not exist.*: none.*"
                                               r"--cpu_devices N"):
        resolve(LaunchConfig(training_script=script, gpus=("0",)), NO_GPUS)


def test_port_in_use(script):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(FleetConfigError, match=rf"port {port} on 127.0.0.1 is already in "
                                                   r"use.*--master host:PORT"):
            resolve(LaunchConfig(training_script=script, master=f"127.0.0.1:{port}"), NO_GPUS)
        # Only node 0 hosts the coordinator: node 1 does not care.
        resolve(LaunchConfig(training_script=script, nnodes=2, node_rank=1,
                             master=f"127.0.0.1:{port}"), NO_GPUS)


@pytest.mark.parametrize("argv,match", [
    (["missing.py"], r"training script 'missing.py' does not exist"),
    (["--gpus", "9", "{script}"], r"GPU id\(s\) 9 do not exist"),
    (["--nnodes", "2", "--node_rank", "5", "--master", "127.0.0.1:1", "{script}"],
     r"--node_rank 5 is outside --nnodes 2"),
])
def test_main_reports_bad_input_and_starts_nothing(tmp_path, script, monkeypatch, capsys,
                                                   argv, match):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    log_dir = tmp_path / "logs"
    argv = ["--log_dir", str(log_dir)] + [a.format(script=script) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetrun: error: ")
    assert re.search(match, err)
    assert not log_dir.exists()


def test_cli_bad_input_exit_code(tmp_path):
    """The installed entry points, end to end: missing script, no worker, exit 2."""
    for command in ([sys.executable, "-m", "fleet.launch"],
                    [os.path.join(os.path.dirname(sys.executable), "fleetrun")]):
        done = subprocess.run([*command, "--log_dir", str(tmp_path / "log"), "nope.py"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 2
        assert "fleetrun: error: training script 'nope.py' does not exist" in done.stderr
        assert not (tmp_path / "log").exists()


# -- the worker environment ---------------------------------------------------------------

def test_single_node_environment(tmp_path, script):
    config = resolve(LaunchConfig(training_script=script, nproc_per_node=2, cpu_devices=3,
                                  job_id="j1"), NO_GPUS)
    specs = plan_workers(config, 0, str(tmp_path), {"XLA_FLAGS": "--xla_foo=1 "
                         "--xla_force_host_platform_device_count=8"})
    envs = [WorkerEnv.from_environ(s.environ) for s in specs]
    assert [(e.rank, e.local_rank, e.world_size, e.local_world_size) for e in envs] == [
        (0, 0, 2, 2), (1, 1, 2, 2)]
    coordinator = envs[0].coordinator
    assert coordinator.startswith("127.0.0.1:") and envs[1].coordinator == coordinator
    assert envs[0].trainer_endpoints == envs[1].trainer_endpoints
    assert envs[0].trainer_endpoints[0] == coordinator
    assert [e.current_endpoint for e in envs] == list(envs[0].trainer_endpoints)
    first = specs[0].environ
    assert first["JAX_COORDINATOR_BIND_ADDRESS"] == coordinator  # loopback only
    assert "JAX_COORDINATOR_BIND_ADDRESS" not in specs[1].environ
    # (issue 12: workers on CPU also keep jax.checkpoint's barriers, fleet/runtime/_xla_flags.py)
    assert first["XLA_FLAGS"] == ("--xla_foo=1 --xla_force_host_platform_device_count=3 "
                                  "--xla_disable_hlo_passes=cse_barrier_expander")
    assert first["JAX_PLATFORMS"] == "cpu"
    assert first["PADDLE_TRAINER_ID"] == "0" and specs[1].environ["PADDLE_TRAINER_ID"] == "1"
    assert first["PADDLE_TRAINERS_NUM"] == "2" and first["FLEET_JOB_ID"] == "j1"
    assert first["FLEET_HEARTBEAT_FILE"] == str(tmp_path / "heartbeat.0")
    assert int(first["FLEET_JAX_HEARTBEAT_TIMEOUT"]) > config.progress_timeout
    restarted = plan_workers(config, 2, str(tmp_path))
    assert WorkerEnv.from_environ(restarted[1].environ).restart_count == 2


def test_multi_node_environment(tmp_path, script):
    config = resolve(LaunchConfig(training_script=script, nproc_per_node=2,
                                  ips=("10.9.9.1", "10.9.9.2"), node_rank=1), NO_GPUS)
    envs = [WorkerEnv.from_environ(s.environ) for s in plan_workers(config, 0, str(tmp_path))]
    assert [e.rank for e in envs] == [2, 3]
    assert {e.world_size for e in envs} == {4} and {e.node_rank for e in envs} == {1}
    assert envs[0].coordinator == "10.9.9.1:6070"
    assert envs[0].trainer_endpoints == ("10.9.9.1:6070", "10.9.9.1:6071",
                                         "10.9.9.2:6070", "10.9.9.2:6071")
    assert [e.current_endpoint for e in envs] == ["10.9.9.2:6070", "10.9.9.2:6071"]


def test_multi_node_addresses(tmp_path, script):
    """Several nodes: the coordinator listens on the master address only, and gloo on
    --node_ip (or the address that reaches the master), never the hostname's."""
    config = resolve(LaunchConfig(training_script=script, nnodes=2, node_rank=0,
                                  node_ip="127.0.0.3", master="127.0.0.1:6170",
                                  cpu_devices=1), NO_GPUS)
    first = plan_workers(config, 0, str(tmp_path))[0].environ
    assert first["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:6170"
    assert first["FLEET_GLOO_ADDRESS"] == "127.0.0.3"
    alone = resolve(LaunchConfig(training_script=script, nproc_per_node=2, cpu_devices=1),
                    NO_GPUS)
    assert {s.environ["FLEET_GLOO_ADDRESS"] for s in plan_workers(alone, 0, str(tmp_path))} \
        == {"127.0.0.1"}


def test_gpu_processes_see_one_gpu_each(tmp_path, script):
    config = resolve(LaunchConfig(training_script=script, gpus=("5", "3")),
                     {"CUDA_VISIBLE_DEVICES": "3,4,5"})
    specs = plan_workers(config, 0, str(tmp_path))
    assert [s.environ["CUDA_VISIBLE_DEVICES"] for s in specs] == ["5", "3"]
    assert [s.environ["FLAGS_selected_gpus"] for s in specs] == ["5", "3"]  # Paddle's
    cpu = resolve(LaunchConfig(training_script=script, cpu_devices=2), NO_GPUS)
    assert "FLAGS_selected_gpus" not in plan_workers(cpu, 0, str(tmp_path))[0].environ


def test_inherited_worker_variables_are_dropped():
    inherited = {"FLEET_RANK": "3", "PADDLE_TRAINER_ENDPOINTS": "x:1", "HOME": "/h",
                 "FLEET_JAX_INIT_TIMEOUT": "20", "JAX_COORDINATOR_BIND_ADDRESS": "0:1",
                 "FLEET_WORKER_PID": "4242"}  # a job started from inside a worker
    assert worker_base_environ(inherited) == {"HOME": "/h", "FLEET_JAX_INIT_TIMEOUT": "20"}


# -- the watchdog -------------------------------------------------------------------------

def test_process_state_sees_a_stopped_process():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 5  # just after exec it may still be loading (D)
        while process_state(proc.pid) == "D" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) in ("S", "R")
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) == "T"
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) is None


def _beat(path, at):
    path.touch()
    os.utime(path, (at, at))


def test_watchdog_heartbeats(tmp_path):
    now = 1000.0
    dog = Watchdog(timeout=10, clock=lambda: now)
    me = os.getpid()  # a running process: never stopped
    w = [Watched(r, me, str(tmp_path / f"hb{r}")) for r in range(3)]
    assert dog.check(w) is None  # nobody has sent a heartbeat: nothing to say
    _beat(tmp_path / "hb0", now - 9)
    _beat(tmp_path / "hb1", now - 5)
    assert dog.check(w) is None
    _beat(tmp_path / "hb0", now - 11)
    stuck = dog.check(w)  # rank 2 never beat while the others did: it is furthest behind
    assert stuck.rank == 2 and "sent no heartbeat" in stuck.reason
    _beat(tmp_path / "hb2", now - 12)
    stuck = dog.check(w)
    assert stuck.rank == 2 and "no progress for 12.0 s" in stuck.reason
    assert "rank 2 fell silent first" in stuck.reason
    assert Watchdog(timeout=0, clock=lambda: now).check(w) is None  # off


def test_watchdog_names_a_stopped_worker(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        while process_state(proc.pid) != "T":
            time.sleep(0.01)
        clock = [1000.0]
        dog = Watchdog(timeout=5, clock=lambda: clock[0])
        w = [Watched(0, os.getpid(), str(tmp_path / "hb0")),
             Watched(1, proc.pid, str(tmp_path / "hb1"))]
        assert dog.check(w) is None  # stopped since now
        clock[0] += 4.9
        assert dog.check(w) is None
        clock[0] += 0.2
        stuck = dog.check(w)
        assert stuck.rank == 1 and stuck.pid == proc.pid
        assert "stopped (state T: SIGSTOP" in stuck.reason
    finally:
        proc.kill()
        proc.wait()


# -- the tables ---------------------------------------------------------------------------

SEED_004_TABLE = """\
-----------  Configuration Arguments -----------
gpus: 0,1
ips: 127.0.0.1
log_dir: log
server_num: None
servers:
training_script: {script}
training_script_args: []
worker_num: None
workers:"""


GLOO = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
TWO_HEADS = ("[Gloo] Rank 0 is connected to {} peer ranks. [Gloo] Rank 1 is connected to {} peer "
             "ranks. Expected number of connected peer ranks is : {}Expected number of connected "
             "peer ranks is : 3")


@pytest.mark.parametrize("line, quiet", [
    (GLOO, True),
    (GLOO.replace("to 1 peer", "to 0 peer"), False),  # a peer missing: echoed
    # Two communicators' notes interleaved (seen on 16 cores): a head, then a whole
    # note on one line, the head's tail on the next.
    ("[Gloo] Rank 0 is connected to 1" + GLOO, True),
    (" peer ranks. Expected number of connected peer ranks is : 1", True),
    ("[Gloo] Rank 1 is connected to 3" + GLOO.replace("1", "3"), True),
    # Two heads, then both tails, on one line (seen on 2 cores, in
    # test_launch_output.py's quick start); a peer missing from one of them is echoed.
    (TWO_HEADS.format(3, 3, 3), True),
    (TWO_HEADS.format(2, 3, 3), False), (TWO_HEADS.format(3, 3, 2), False),
    # The script's own lines stay, a lone number or a note's words among them.
    ("1", False), (": 1", False), ("step 1", False), ("", False),
    ("loss 0.5 " + GLOO, False), (GLOO + " loss 0.5", False),
])
def test_only_gloos_full_connection_notes_leave_the_echo(line, quiet):
    assert quiet_line(line) is quiet


def test_tables(script):
    given = LaunchConfig(training_script=script, gpus=("0", "1"))
    config = resolve(given, {"CUDA_VISIBLE_DEVICES": "0,1"})
    text = config_table(config.table(given))
    assert text.startswith(SEED_004_TABLE.format(script=script) + "\n")  # the seed's rows
    lines = text.splitlines()
    assert lines[10:] == sorted(lines[10:-1]) + [lines[-1]]  # then fleet's, by name
    assert "nproc_per_node: 2" in lines and "progress_timeout: 600.0" in lines
    assert lines[-1] == "------------------------------------------------"
    # --ips given, --gpus not: Paddle shows what was given.
    given = LaunchConfig(training_script=script, ips=("10.9.9.1", "127.0.0.1"))
    lines = config_table(resolve(given, NO_GPUS).table(given)).splitlines()
    assert lines[1:3] == ["gpus: None", "ips: 10.9.9.1,127.0.0.1"]
    assert "node_rank: 1" in lines and "master: 10.9.9.1:6070" in lines

    env = {"PADDLE_TRAINER_ID": "0", "FLEET_RANK": "0", "LONG": "x" * 100,
           "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:1", "FLAGS_selected_gpus": "0",
           "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:1,127.0.0.1:2"}
    table = env_table(env)
    names = [line.split()[1] for line in table.splitlines()[3:-1]]
    assert names == ["PADDLE_CURRENT_ENDPOINT", "PADDLE_TRAINERS_NUM", "FLAGS_selected_gpus",
                     "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID"]  # the seed's order
    verbose = env_table(env, verbose=True)
    names = [line.split()[1] for line in verbose.splitlines()[3:-1]]
    assert names[:5] == ["PADDLE_CURRENT_ENDPOINT", "PADDLE_TRAINERS_NUM",
                         "FLAGS_selected_gpus", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID"]
    assert names[5:] == ["FLEET_RANK", "LONG"]
    assert "Distributed Envs" in table
    assert "..." + "x" * 42 in verbose
    assert len({len(line) for line in verbose.splitlines()}) == 1  # a straight box


def _progress(path, begun, ended, state, at):
    path.write_text(f"{begun} {ended} {state}".ljust(48) + "\n")
    os.utime(path, (at, at))


def test_watchdog_uneven_steps(tmp_path):
    now = [1000.0]
    dog = Watchdog(timeout=600, clock=lambda: now[0])
    me = os.getpid()
    w = [Watched(r, me, str(tmp_path / f"hb{r}"), started=900.0) for r in range(2)]
    _progress(tmp_path / "hb0", 6, 6, "run", now[0] - 1)  # dispatched a 6th step
    _progress(tmp_path / "hb1", 5, 5, "done", now[0] - 1)  # ended after 5 steps
    assert dog.check(w) is None  # rank 1 finished just now: not yet
    now[0] += 9.9
    assert dog.check(w) is None
    now[0] += 0.2
    stuck = dog.check(w)
    assert stuck.rank == 0
    assert stuck.reason.startswith("uneven steps: rank 0 ran more steps (6) than rank 1 (5)")
    # The job's last line names both counts too (issue 22).
    assert Failure(0, me, stuck=stuck.reason, stuck_brief=stuck.brief).short == (
        "is stuck in its step 6, in a collective that rank 1 never joins: rank 1 ended "
        "after 5 steps (uneven steps)")
    # Equal counts: rank 0 is saving alone after the last step; nothing to say for 600 s.
    _progress(tmp_path / "hb0", 5, 5, "run", now[0])
    now[0] += 599
    assert dog.check(w) is None
    now[0] += 2
    stuck = dog.check(w)
    assert stuck.rank == 0 and "no progress for 601.0 s" in stuck.reason  # never rank 1
    assert "rank 1: finished" in stuck.reason


def test_watchdog_covers_the_time_before_the_first_step(tmp_path):
    now = [1000.0]
    dog = Watchdog(timeout=3, clock=lambda: now[0])
    me = os.getpid()
    w = [Watched(r, me, str(tmp_path / f"hb{r}"), started=now[0]) for r in range(2)]
    now[0] += 29.9  # the first step gets at least 30 s (imports, compilation)
    assert dog.check(w) is None
    now[0] += 0.2
    stuck = dog.check(w)
    assert stuck.rank == 0 and "no step started within 30 s of the start" in stuck.reason
    assert Watchdog(timeout=100, clock=lambda: now[0]).check(w) is None  # 100 s > 30 s
    # Until the first step returns (it compiles), the same allowance; then the timeout.
    _progress(tmp_path / "hb0", 1, 0, "run", now[0] - 29.9)
    _progress(tmp_path / "hb1", 1, 0, "run", now[0] - 29.9)
    assert dog.check(w) is None
    now[0] += 0.2
    stuck = dog.check(w)
    assert stuck.rank == 0 and "(the first step's limit, 30 s)" in stuck.reason
    _progress(tmp_path / "hb0", 2, 1, "run", now[0] - 3.1)
    _progress(tmp_path / "hb1", 2, 1, "run", now[0] - 1)
    stuck = dog.check(w)
    assert stuck.rank == 0 and "no progress for 3.1 s (--progress_timeout 3 s)" in stuck.reason


def test_watchdog_waits_are_settings(tmp_path):
    """--first_step_min and --uneven_grace replace the 30 s and 10 s defaults."""
    now = [1000.0]
    dog = Watchdog(timeout=600, clock=lambda: now[0], first_step_min=2, uneven_grace=0.5)
    me = os.getpid()
    w = [Watched(r, me, str(tmp_path / f"hb{r}"), started=now[0]) for r in range(2)]
    now[0] += 1.9
    assert dog.check(w) is None
    now[0] += 0.2
    stuck = Watchdog(timeout=1, clock=lambda: now[0], first_step_min=2).check(w)
    assert stuck.rank == 0 and "no step started within 2 s of the start" in stuck.reason
    assert "at least 2 s" in stuck.reason
    _progress(tmp_path / "hb0", 6, 6, "run", now[0])  # dispatched a 6th step
    _progress(tmp_path / "hb1", 5, 5, "done", now[0])  # ended after 5 steps
    assert dog.check(w) is None
    now[0] += 0.6
    stuck = dog.check(w)
    assert stuck.rank == 0 and stuck.reason.startswith("uneven steps: rank 0 ran more steps")
    assert "has waited 0.6 s" in stuck.reason


# -- layering: the core never imports the launcher ------------------------------------------

def test_the_core_does_not_import_the_launcher():
    """Issue 9's rule: the worker's side of the contract lives in fleet/runtime/_worker.py; only
    the package's public face (fleet/__init__.py: fleet.spawn) names fleet.launch."""
    import ast
    from pathlib import Path

    import fleet

    root = Path(fleet.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "launch" or path == root / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "fleet":
                names += [f"fleet.{a.name}" for a in node.names]
            offenders += [f"{path.relative_to(root)}: {n}" for n in names
                          if n == "fleet.launch" or n.startswith("fleet.launch.")]
    assert offenders == []


def test_options_after_the_script_are_the_scripts():
    """A script's own --verbose is not an abbreviation of fleetrun's --verbose_env,
    and fleetrun's option names after the script belong to the script."""
    from fleet.launch._args import parse_args

    ns = parse_args(["--nproc_per_node", "2", "train.py", "--verbose", "2", "--nproc_per_node", "5"])
    assert ns.training_script == "train.py"
    assert ns.training_script_args == ("--verbose", "2", "--nproc_per_node", "5")
    assert ns.nproc_per_node == 2


def test_a_worker_killed_by_a_signal_is_named_before_the_peers_it_made_fail():
    """kill -9 of rank 1 makes rank 0 raise in its next collective; the launcher may
    hear of rank 0's exit first. Exits that arrive within _SETTLE seconds count, and
    a signal death comes first. The one supervisor does this for fleetrun and
    fleet.spawn alike (fleet/launch/_supervisor.py)."""
    from fleet.launch import _supervisor
    from fleet.launch._worker_plan import WorkerSpec

    def exited(rank, returncode, error=None):
        worker = _supervisor.Worker(WorkerSpec(rank, rank, {"FLEET_HEARTBEAT_FILE": ""}), pid=0)
        worker.returncode, worker.error = returncode, error
        return worker

    supervisor = _supervisor.Supervisor(LaunchConfig())
    raised, killed = exited(0, 1), exited(1, -9)
    supervisor._events.put(exited(2, 0))
    supervisor._events.put(killed)
    assert supervisor._culprit(raised) is killed
    started = time.monotonic()
    assert supervisor._culprit(raised) is raised  # alone: named after the settling time
    assert _supervisor._SETTLE <= time.monotonic() - started < _supervisor._SETTLE + 1
    supervisor._events.put(raised)
    assert supervisor._culprit(killed) is killed  # a signal death first: named at once
    assert supervisor._events.qsize() == 1
    # fleet.spawn's child that sent a traceback failed, whatever its exit status.
    assert exited(3, 0, error="Traceback ...").failed and not exited(3, 0).failed


def test_the_worker_whose_script_failed_first_is_named(tmp_path):
    """Rank 1's sys.exit(3) makes rank 0 fail in its collective (exit 1), and the
    launcher may hear of rank 0 first. Each failing script marks the time it
    failed in its heartbeat file (fleet.runtime._heartbeat.mark_failed): the earliest is named."""
    from fleet.launch import _supervisor
    from fleet.launch._worker_plan import WorkerSpec
    from fleet.runtime import _heartbeat

    def failed(rank, returncode, at):
        path = tmp_path / f"beat{rank}"
        if at is not None:
            path.write_text(f"5 4 failed:{at:.6f}".ljust(_heartbeat.PROGRESS_WIDTH) + "\n")
        worker = _supervisor.Worker(WorkerSpec(rank, rank, {"FLEET_HEARTBEAT_FILE": str(path)}),
                                    pid=0)
        worker.returncode = returncode
        return worker

    supervisor = _supervisor.Supervisor(LaunchConfig())
    consequence, cause = failed(0, 1, 1000.5), failed(1, 3, 1000.2)
    supervisor._events.put(cause)
    assert supervisor._culprit(consequence) is cause
    unmarked = failed(2, 1, None)  # no mark (a worker outside fleet): named last
    supervisor._events.put(unmarked)
    assert supervisor._culprit(consequence) is consequence
