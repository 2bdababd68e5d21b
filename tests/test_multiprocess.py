"""Two real processes x two CPU devices each, over jax.distributed with gloo
collectives on 127.0.0.1 (no launcher), train the same model as one device."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests import models

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_workers(arg: str) -> list[tuple[int, str]]:
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(
            os.environ,
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_PLATFORMS="cpu",
            FLEET_RANK=str(rank),
            FLEET_WORLD_SIZE="2",
            FLEET_COORDINATOR=f"127.0.0.1:{port}",
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "tests/workers/core_train.py"), arg],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, log) for p, log in zip(procs, logs)]


def test_two_processes_match_single_card(tmp_path):
    """Also checks all_reduce / broadcast / all_gather / barrier across processes."""
    out = tmp_path / "result.npz"
    results = run_two_workers(str(out))
    assert [code for code, _ in results] == [0, 0], "\n".join(log for _, log in results)

    ref_losses, ref_params = models.nnx_reference("linear", models.batches("linear", 10, 16))
    result = np.load(out)
    assert np.abs(result["losses"] - np.array(ref_losses)).max() < 1e-5
    assert models.max_diff({k: result[k] for k in ref_params}, ref_params) < 1e-5


def test_models_that_differ_across_processes_are_refused():
    for code, log in run_two_workers("mismatch"):
        assert code != 0
        assert ("parameter 'layers.0.bias' differs in shape or dtype between process 0 and "
                "process 1 (here: shape (1") in log, log
