"""A silent worker is told of long before ``--progress_timeout`` ends the job (issue 22).

With the default ``--progress_timeout`` of 600 s a stopped worker (``SIGSTOP``, a
stuck filesystem) would end the job only after ten minutes of nothing on the
console. The watchdog (``fleet/launch/_watchdog.py``) warns after
``--silence_warning`` seconds (60) of silence and again every as many seconds,
naming the rank, its pid, how long it has been silent and the time left.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet.launch._watchdog import Watchdog, Watched, process_state
from tests.tiers import slow

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
LOOP = str(SCRIPTS / "train_loop.py")


def _progress(path, begun, ended, at):
    path.write_text(f"{begun} {ended} run".ljust(48) + "\n")
    os.utime(path, (at, at))


def test_warning_lines_then_every_interval(tmp_path):
    now = [1000.0]
    lines = []
    dog = Watchdog(timeout=600, clock=lambda: now[0], warn=lines.append)
    me = os.getpid()
    w = [Watched(r, me, str(tmp_path / f"hb{r}"), started=900.0) for r in range(2)]
    _progress(tmp_path / "hb0", 4, 4, now[0] - 10)
    _progress(tmp_path / "hb1", 3, 3, now[0] - 59.9)
    assert dog.check(w) is None and lines == []  # 59.9 s: nothing yet
    now[0] += 0.2
    assert dog.check(w) is None
    assert lines == [f"rank 1 (pid {me}) has been silent for 60 s (steps started: 3, ended: 3); "
                     "--progress_timeout 600 s ends the job in 540 s unless a heartbeat comes"]
    now[0] += 30
    dog.check(w)
    assert len(lines) == 1  # one line a minute, not one a check
    now[0] += 30
    dog.check(w)
    assert len(lines) == 2 and "silent for 120 s" in lines[1] and "silent too: rank 0" in lines[1]
    assert "ends the job in 480 s" in lines[1]
    # A beat ends the silence; the next silence starts from 60 s again.
    _progress(tmp_path / "hb0", 5, 5, now[0])
    _progress(tmp_path / "hb1", 4, 4, now[0])
    now[0] += 59
    dog.check(w)
    assert len(lines) == 2
    now[0] += 1
    dog.check(w)
    assert len(lines) == 3 and "rank 0 (pid" in lines[2] and "silent for 60 s" in lines[2]
    # Off: --silence_warning 0, or the watchdog itself off (--progress_timeout 0).
    for quiet in (Watchdog(600, clock=lambda: now[0], silence_warning=0, warn=lines.append),
                  Watchdog(0, clock=lambda: now[0], warn=lines.append)):
        now[0] += 100
        assert quiet.check(w) is None
    assert len(lines) == 3
    # In the first step (it compiles): said so.
    _progress(tmp_path / "hb0", 1, 0, now[0] - 60)
    _progress(tmp_path / "hb1", 1, 0, now[0] - 61)
    Watchdog(600, clock=lambda: now[0], warn=lines.append).check(w)
    assert lines[3].startswith(f"rank 1 (pid {me}) has been silent for 61 s (in its first "
                               "step, which compiles, or stuck); silent too: rank 0 (60 s)")


def test_warning_before_the_first_heartbeat_and_of_a_stopped_worker(tmp_path):
    now = [1000.0]
    lines = []
    dog = Watchdog(timeout=600, clock=lambda: now[0], silence_warning=5, warn=lines.append)
    w = [Watched(0, os.getpid(), str(tmp_path / "hb0"), started=now[0])]
    now[0] += 5
    dog.check(w)
    assert lines == [f"rank 0 (pid {os.getpid()}) has been silent for 5 s (no heartbeat since it "
                     "started: still importing or compiling, or stuck); --progress_timeout 600 s "
                     "ends the job in 595 s unless a heartbeat comes"]
    proc = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        while process_state(proc.pid) != "T":
            time.sleep(0.01)
        stopped = [*w, Watched(1, proc.pid, str(tmp_path / "hb1"), started=now[0])]
        dog.check(stopped)  # seen stopped from now on
        _progress(tmp_path / "hb0", 2, 2, now[0] + 4)
        now[0] += 10
        dog.check(stopped)
        assert lines[-1] == (f"rank 1 (pid {proc.pid}) has been silent for 10 s (its process is "
                             "stopped, state T: SIGSTOP, Ctrl-Z or a debugger); silent too: rank "
                             "0 (6 s); --progress_timeout 600 s ends the job in 590 s unless a "
                             "heartbeat comes")
    finally:
        proc.kill()
        proc.wait()


@slow
@pytest.mark.timeout(180)
def test_a_stopped_worker_is_warned_of_then_ends_the_job(jobs):
    """A real job: rank 1 stops itself (SIGSTOP) after its first step. The launcher's
    console names it every 2 s (--silence_warning 2), then --progress_timeout 10
    ends the job naming it."""
    timeout = 10
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1", "--progress_timeout", str(timeout),
               "--silence_warning", "2", LOOP, "--stop_rank", "1", "--stop_step", "1")
    job.wait_for_log(1, r"rank 1 stops itself at step 1", timeout=120)
    pid = job.pid(1)
    stopped = time.monotonic()
    code = job.wait(timeout=timeout + 20)
    elapsed = time.monotonic() - stopped
    text = job.output
    assert code == 124, text
    warned = re.findall(rf"WARNING .*\] rank 1 \(pid {pid}\) has been silent for (\d+) s \(its "
                        r"process is stopped, state T.*; --progress_timeout 10 s ends the job in "
                        r"(\d+) s unless a heartbeat comes\n", text)
    assert len(warned) >= 3, text  # at about 2, 4, 6 and 8 s
    silent = [int(s) for s, _ in warned]
    assert silent == sorted(silent) and silent[0] >= 2 and silent[-1] < timeout, text
    assert all(int(s) + int(left) in range(timeout - 1, timeout + 2) for s, left in warned)
    assert text.index("has been silent for") < text.index("is stuck")
    assert re.search(rf"rank 1 \(pid {pid}\) is stuck: its process has been stopped", text), text
    assert "job failed: rank 1 is stuck; exit code 124" in text
    assert timeout - 1 < elapsed < timeout + 10, elapsed
    print(f"{len(warned)} warning lines; the job ended {elapsed:.1f} s after the stop")
