"""What went wrong with a worker, said the same way by ``fleetrun`` and ``fleet.spawn``."""

from __future__ import annotations

import dataclasses
import os
import signal

from fleet._errors import FleetError

# Exit code of a job whose worker the watchdog found stuck (as timeout(1) does).
STUCK_EXIT_CODE = 124
TAIL_LINES = 30


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first worker that failed: it exited non-zero, died of a signal, or is stuck."""

    rank: int
    pid: int
    returncode: int | None = None  # None: stuck (see ``stuck``)
    stuck: str | None = None
    stuck_brief: str | None = None  # the stuck reason in a few words, for the last line
    error: str | None = None  # the error text the worker sent (fleet.spawn: its traceback)
    log_path: str | None = None
    log_offset: int = 0  # where this attempt's output starts in the log

    @property
    def how(self) -> str:
        """In words: ``exited with code 3``, ``was killed by signal SIGKILL (9)``, ``is stuck: ...``."""
        if self.returncode is None:
            return f"is stuck: {self.stuck}"
        if self.returncode < 0:
            return f"was killed by signal {signal_name(-self.returncode)} ({-self.returncode})"
        return f"exited with code {self.returncode}"

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + N for a death by signal N (124 when stuck)."""
        if self.returncode is None:
            return STUCK_EXIT_CODE
        return 128 - self.returncode if self.returncode < 0 else self.returncode or 1

    @property
    def short(self) -> str:
        """``how`` without the watchdog's full explanation (its brief form, if any):
        the job's last line."""
        if self.returncode is not None:
            return self.how
        return "is stuck" + (f" {self.stuck_brief}" if self.stuck_brief else "")

    def summary(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) {self.how}"

    def log_tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last ``lines`` lines this worker wrote in this attempt (of its last 64 KiB)."""
        if not self.log_path:  # fleet.spawn's workers keep no log
            return []
        try:
            with open(self.log_path, "rb") as f:
                start = max(self.log_offset, os.fstat(f.fileno()).st_size - 64 * 1024)
                f.seek(start)
                tail = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []
        if start > self.log_offset and tail:
            tail = tail[1:]  # a partial first line
        return tail[-lines:]


class WorkerFailedError(FleetError, RuntimeError):
    """A worker of ``fleet.spawn`` failed; the message holds its traceback.

    Attributes:
        rank: the failed worker's rank.
        exitcode: its exit code (128 + N for signal N; 124 when stuck).
        worker_traceback: the traceback text the worker sent, if it raised.
    """

    def __init__(self, message: str, rank: int, exitcode: int, worker_traceback: str | None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.worker_traceback = worker_traceback
