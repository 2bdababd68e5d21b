"""Starting checkpoint workers from the tests: one process, or a fleetrun job of
two processes x 2 CPU devices over gloo on 127.0.0.1 (tests/jobs.py). Every
start has a timeout and kills what it started."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

from tests import jobs

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests/workers/ckpt_train.py")


def _env(devices: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "PADDLE_"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def start(args: list, devices: int, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, WORKER, *map(str, args)], env=_env(devices, **env),
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def run_one(tmp_path: Path, args: list, devices: int, timeout: float = 120) -> str:
    """Runs one worker process with ``devices`` CPU devices; returns its log."""
    log = tmp_path / f"one-{uuid.uuid4().hex[:8]}.log"
    proc = start(args, devices, log)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text(errors="replace")
    assert code == 0, text
    return text


def run_two(tmp_path: Path, args: list, timeout: float = 180) -> list[str]:
    """Runs a fleetrun job of 2 processes x 2 CPU devices; returns their logs."""
    job = jobs.two_processes(tmp_path, WORKER, *map(str, args), timeout=timeout,
                             name=f"two-{jobs.free_port()}")
    return job.logs(2)


def load(path: Path, drop: tuple = ()) -> dict:
    return {k: v for k, v in np.load(path).items() if k not in drop}
