"""Starting checkpoint workers from the tests: one process, or two launcher-free
processes x 2 CPU devices over gloo on 127.0.0.1. Every start has a timeout and
kills what it started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests/workers/ckpt_train.py")


def _env(devices: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "PADDLE_"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list, devices: int, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, WORKER, *map(str, args)], env=_env(devices, **env),
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def run_one(tmp_path: Path, args: list, devices: int, timeout: float = 120) -> str:
    """Runs one worker process with ``devices`` CPU devices; returns its log."""
    log = tmp_path / f"one-{free_port()}.log"
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
    """Runs a job of 2 processes x 2 CPU devices (no launcher); returns their logs."""
    port, procs, logs = free_port(), [], []
    for rank in range(2):
        logs.append(tmp_path / f"two-{port}-{rank}.log")
        procs.append(start(args, 2, logs[-1], FLEET_RANK=str(rank), FLEET_WORLD_SIZE="2",
                           FLEET_COORDINATOR=f"127.0.0.1:{port}"))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "\n".join(texts)
    return texts


def load(path: Path, drop: tuple = ()) -> dict:
    return {k: v for k, v in np.load(path).items() if k not in drop}
