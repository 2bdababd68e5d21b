"""Running a worker script as a real ``fleetrun`` job from a test."""

import os
import subprocess
import sys
from pathlib import Path

FLEETRUN = os.path.join(os.path.dirname(sys.executable), "fleetrun")


class Jobs:
    """Starts ``fleetrun`` jobs in a directory; :meth:`close` kills any left running."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.procs: list[subprocess.Popen] = []

    def run(self, script: str, processes: int, local_devices: int, job_id: str,
            timeout: float = 180) -> tuple[str, list[str]]:
        """Writes ``script`` to worker.py, runs it on ``processes`` x ``local_devices``
        CPU devices and returns the console output and each rank's log; fails the
        test (with the logs' tails) if the job fails."""
        (self.cwd / "worker.py").write_text(script)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        proc = subprocess.Popen(
            [FLEETRUN, "--nproc_per_node", str(processes), "--cpu_devices", str(local_devices),
             "--log_dir", "log", "--job_id", job_id, "worker.py"],
            cwd=self.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        output, _ = proc.communicate(timeout=timeout)
        logs = [(self.cwd / "log" / f"workerlog.{r}").read_text() for r in range(processes)]
        assert proc.returncode == 0, output[-3000:] + "".join(log[-3000:] for log in logs)
        return output, logs

    def close(self) -> None:
        for p in self.procs:  # hermetic even when an assertion fired
            if p.poll() is None:
                p.kill()
                p.wait()
