"""Jobs started by a cluster's own launcher (SLURM's srun, Open MPI's mpirun), imitated
on loopback the way JAX's own tests do: each process gets the variables that launcher
sets, and nothing of fleet's. Two processes must train one job, equal to the
one-process reference (and so to fleetrun); processes that cannot join must not train
alone silently.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet import FleetConfigError
from fleet.runtime._env import WorkerEnv
from tests import jobs
from tests.tiers import slow

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

TRAIN = str(SCRIPTS / "train_linear.py")
def clean_environ(devices=2):
    """A process started by a cluster's own launcher (no fleetrun): its devices by hand."""
    return jobs.clean_environ(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                              JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                              FLEET_JAX_INIT_TIMEOUT="30")


def slurm(rank, port):
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
            "JAX_COORDINATOR_PORT": str(port),
            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}


def open_mpi(rank, port):
    return {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911",
            "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "JAX_COORDINATOR_PORT": str(port),
            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}


def start_copies(tmp_path, envs, args):
    """One process per environment, each running train_linear.py; returns their outputs."""
    procs = []
    try:
        for i, env in enumerate(envs):
            out = open(tmp_path / f"copy{i}.out", "wb")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen([sys.executable, TRAIN, *args(i)], stdout=out,
                                           stderr=subprocess.STDOUT, cwd=tmp_path, env=env),
                          out))
        deadline = time.monotonic() + 120
        codes = [p.wait(timeout=max(1, deadline - time.monotonic())) for p, _ in procs]
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
    return codes, [(tmp_path / f"copy{i}.out").read_text(errors="replace")
                   for i in range(len(envs))]


@pytest.fixture(scope="module")
def reference():
    from linear_common import train_reference

    return train_reference()


def assert_same_params(path, reference):
    from linear_common import assert_same_params as same

    same(path, reference)


@slow
@pytest.mark.parametrize("cluster", [slurm, open_mpi], ids=["slurm", "open_mpi"])
def test_cluster_launcher_trains_one_job(tmp_path, reference, cluster):
    port = jobs.free_port()
    out = tmp_path / "params.npz"
    codes, outputs = start_copies(
        tmp_path, [{**clean_environ(), **cluster(rank, port)} for rank in (0, 1)],
        lambda i: [str(out)])
    assert codes == [0, 0], "\n".join(outputs)
    assert_same_params(out, reference)  # rank 0 saved; 2 x 2 devices, global batch 16
    for rank, text in enumerate(outputs):
        assert "training alone" not in text
        assert f"rank {rank} of processes: 2" in text


@slow
def test_hand_started_copies_say_what_they_do(tmp_path, reference):
    """Two copies with no job variables: each trains alone over its own devices and
    says so in one line (issue 23: what it does, not a warning); a copy whose
    environment says it is one of several (torchrun's WORLD_SIZE) is warned."""
    codes, outputs = start_copies(
        tmp_path, [clean_environ(), {**clean_environ(), "WORLD_SIZE": "2"}],
        lambda i: [str(tmp_path / f"params{i}.npz")])
    assert codes == [0, 0], "\n".join(outputs)
    for i, text in enumerate(outputs):
        notes = [line for line in text.splitlines() if line.startswith("fleet: ")]
        said = ("fleet: 1 process, 2 CPU devices: data-parallel over this process's devices "
                "(fleetrun starts several processes)")
        warned = ("fleet: training alone in one process (WORLD_SIZE=2 (torchrun's variable) "
                  "says this is one of 2 processes, but fleet reads FLEET_* / PADDLE_* "
                  "variables: start the job with fleetrun)")
        assert notes == ([warned] if i else []) + [said], text
        assert "rank 0 of processes: 1" in text
        assert_same_params(tmp_path / f"params{i}.npz", reference)


# -- the environment alone (no processes) -----------------------------------------------------

def test_cluster_variables_give_the_worker_environment():
    env = WorkerEnv.from_environ({**slurm(1, 1234), "SLURM_NODEID": "0"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (
        1, 2, 1, 2, "SLURM")
    env = WorkerEnv.from_environ(open_mpi(0, 1234))
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 2, 0, "Open MPI")
    # fleet's own variables win over a cluster's (fleetrun started inside srun).
    env = WorkerEnv.from_environ({**slurm(1, 1234), "FLEET_RANK": "0", "FLEET_WORLD_SIZE": "4",
                                  "FLEET_COORDINATOR": "127.0.0.1:1"})
    assert (env.rank, env.world_size, env.launcher) == (0, 4, "fleet")
    # An srun step of one task is a one-process job.
    env = WorkerEnv.from_environ({**slurm(0, 1234), "SLURM_NTASKS": "1"})
    assert not env.is_multiprocess


@pytest.mark.parametrize("variables,match", [
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
     r"OMPI_COMM_WORLD_SIZE=2 and OMPI_COMM_WORLD_RANK=1 say this process is one of 2.*"
     r"Open MPI 5 sets no OMPI_MCA_orte_hnp_uri.*cannot join them"),
    ({"PMI_SIZE": "4", "PMI_RANK": "0"}, r"PMI_SIZE=4 .* one of 4, started by an MPI launcher"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, r"WORLD_SIZE=2 .* torchrun"),
])
def test_one_of_several_that_cannot_join_raises(variables, match):
    with pytest.raises(FleetConfigError, match=match):
        WorkerEnv.from_environ(variables)


def test_one_of_several_that_cannot_join_raises_in_fleet_init(tmp_path):
    env = {**clean_environ(1), "PMI_SIZE": "2", "PMI_RANK": "1"}
    proc = subprocess.run([sys.executable, TRAIN, str(tmp_path / "p.npz")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1
    assert "FleetConfigError: PMI_SIZE=2 and PMI_RANK=1 say this process is one of 2" in (
        proc.stderr)
    assert not (tmp_path / "p.npz").exists()
