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


def describe_returncode(returncode: int) -> str:
    """``Popen.returncode`` in words: ``exited with code 3`` / ``was killed by SIGKILL``."""
    if returncode < 0:
        return f"was killed by signal {signal_name(-returncode)} ({-returncode})"
    return f"exited with code {returncode}"


def exit_code_of(returncode: int) -> int:
    """The shell's convention: a death by signal N is exit code 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


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
        if self.returncode is None:
            return f"is stuck: {self.stuck}"
        return describe_returncode(self.returncode)

    @property
    def exit_code(self) -> int:
        if self.returncode is None:
            return STUCK_EXIT_CODE
        return exit_code_of(self.returncode) or 1

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
        """The last ``lines`` lines this worker wrote in this attempt."""
        if not self.log_path:
            return []
        return read_tail(self.log_path, self.log_offset, lines)


def read_tail(path: str, offset: int, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(offset, size - 64 * 1024)
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    tail = text.splitlines()
    if start > offset and tail:
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
