"""Starting real jobs from a test: the one launcher helper and the one free port.

Every multi-process test starts its processes through the real launcher
(:class:`Job`, :func:`run`), each job with its own ``--job_id``: "no process
remains" means no process on the machine still carries that ``FLEET_JOB_ID``.
The workers get the test process's environment without its job variables and
without its ``XLA_FLAGS`` (8 fake devices): ``--cpu_devices`` gives them their
own. JAX's compilation cache (``tests/conftest.py``) reaches them through the
environment.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from job_processes import job_processes, wait_until_gone  # noqa: E402

FLEETRUN = os.path.join(os.path.dirname(sys.executable), "fleetrun")
# Variables of any launcher: the test machine's own must not leak into a job.
JOB_PREFIXES = ("FLEET_", "PADDLE_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_COORDINATOR")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment less job variables and ``XLA_FLAGS``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(JOB_PREFIXES) and k not in ("WORLD_SIZE", "RANK", "XLA_FLAGS")}
    env.update(extra)
    return env


class Job:
    """One launcher (one node) in the background, its console in a file.

    Args:
        cwd: the job's working directory; its console goes to ``cwd/NAME.out`` and
            its worker logs to ``cwd/NAME-log``.
        *args: the launcher's arguments (the script and its arguments last).
        name: tells apart several launchers in one directory.
        job_id: ``--job_id`` (default: a fresh one).
        entry: the launcher's command (default ``fleetrun``).
        env: variables on top of :func:`clean_environ`.
    """

    def __init__(self, cwd: Path, *args: str, name: str = "job", job_id: str | None = None,
                 entry: list[str] | None = None, env: dict[str, str] | None = None):
        self.cwd, self.log_dir = Path(cwd), Path(cwd) / f"{name}-log"
        self.job_id = job_id or f"test-{uuid.uuid4().hex[:10]}"
        self.out_path = self.cwd / f"{name}.out"
        with open(self.out_path, "wb") as out:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                [*(entry or [FLEETRUN]), "--job_id", self.job_id, "--log_dir", str(self.log_dir),
                 *args],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd, env=clean_environ(**(env or {})),
            )
        self.seconds: float | None = None

    def wait(self, timeout: float) -> int:
        """The launcher's exit code; kills the job if it outlives ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job ran past {timeout} s:\n{self.output[-4000:]}") from None
        self.seconds = time.monotonic() - self.started
        return code

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def log(self, rank: int) -> str:
        path = self.log_dir / f"workerlog.{rank}"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, n: int) -> list[str]:
        return [self.log(rank) for rank in range(n)]

    def text(self, n: int = 2) -> str:
        """The console, then the first ``n`` ranks' logs."""
        return self.output + "".join(self.logs(n))

    def wait_for_log(self, rank: int, pattern: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log(rank)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} never logged {pattern!r}:\n{self.output}")
            time.sleep(0.05)

    def pid(self, rank: int) -> int:
        for p in job_processes(self.job_id):
            if p.environ().get("FLEET_RANK") == str(rank) and p.ppid() == self.proc.pid:
                return p.pid
        raise AssertionError(f"no worker of rank {rank}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def left(self, timeout: float = 5.0) -> list:
        """The job's processes still alive after ``timeout`` seconds."""
        return wait_until_gone(self.job_id, timeout=timeout)

    def end(self) -> list:
        """Kills whatever is left of the job; returns what was left."""
        self.kill()
        left = self.left()
        for p in left:
            p.kill()
        return left


def run(cwd: Path, *args: str, timeout: float = 180, ok: bool = True, **kwargs) -> Job:
    """Runs a job to its end (killed past ``timeout``) and kills whatever it left.

    With ``ok``, a job that fails fails the test, with its console and logs' tails."""
    job = Job(cwd, *args, **kwargs)
    try:
        job.wait(timeout)
    finally:
        job.end()
    if ok:
        assert job.returncode == 0, (job.output[-3000:] + "".join(
            log[-3000:] for log in job.logs(4)))
    return job


def two_processes(cwd: Path, script: str, *script_args: str, devices: int = 2,
                  timeout: float = 180, **kwargs) -> Job:
    """:func:`run`: ``script`` on 2 processes x ``devices`` CPU devices."""
    return run(cwd, "--nproc_per_node", "2", "--cpu_devices", str(devices), str(script),
               *script_args, timeout=timeout, **kwargs)


@pytest.fixture
def jobs(tmp_path):
    """``jobs(*args, **kwargs)`` starts a :class:`Job`; afterwards checks (and enforces)
    that none of their processes remain."""
    started = []

    def start(*args, **kwargs):
        job = Job(tmp_path, *args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()
    for job in started:
        left = job.end()
        assert not left, f"processes of job {job.job_id} remain: {left}"
