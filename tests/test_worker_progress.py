"""The worker's step counts in its heartbeat file (``fleet.runtime._worker``, issue 24): a
step call only counts, the file is written at most every ``BEAT_INTERVAL``, and
the counts a burst of steps left unwritten reach the file within that interval
(the launcher reads them to tell uneven steps from a deadlock)."""

import os
import time

import pytest

from fleet.runtime import _heartbeat
from fleet.runtime._heartbeat import read_progress


@pytest.fixture
def heartbeat(tmp_path, monkeypatch):
    """A heartbeat file for this process, and the worker's counts from zero."""
    path = tmp_path / "heartbeat.0"
    monkeypatch.setenv(_heartbeat.ENV, str(path))
    saved = dict(_heartbeat._progress)
    _heartbeat._progress.update(fd=None, begun=0, ended=0, path=None, at=float("-inf"),
                             written=None, state="run", flusher=None, changed=None,
                                failed_at=None)
    writes = []
    pwrite = os.pwrite
    monkeypatch.setattr(_heartbeat.os, "pwrite", lambda *a: writes.append(a) or pwrite(*a))
    yield path, writes
    _heartbeat._progress["state"] = "done"  # ends the flusher
    flusher = _heartbeat._progress["flusher"]
    if flusher is not None:
        flusher.join(timeout=5)
    _heartbeat._progress.clear()
    _heartbeat._progress.update(saved)


def test_a_burst_of_steps_writes_a_few_times_and_ends_with_its_counts(heartbeat):
    path, writes = heartbeat
    start = time.monotonic()
    for _ in range(2000):
        _heartbeat.step_begin()
        _heartbeat.step_end()
    elapsed = time.monotonic() - start
    assert len(writes) <= 2 + elapsed / _heartbeat.BEAT_INTERVAL, (len(writes), elapsed)
    last = time.time()
    time.sleep(3 * _heartbeat.BEAT_INTERVAL)  # the flusher writes what the burst left
    progress = read_progress(str(path))
    assert (progress.begun, progress.ended) == (2000, 2000)
    # the beat is when the counts last changed, not when the flusher wrote them: the
    # watchdog tells which worker fell silent first by it
    assert last - 0.05 <= progress.beat <= last, (progress.beat, last)


def test_a_step_that_blocks_leaves_its_begun_count(heartbeat):
    """A worker stuck inside its next step (a dead peer) shows begun > ended."""
    path, _ = heartbeat
    for _ in range(5):
        _heartbeat.step_begin()
        _heartbeat.step_end()
    _heartbeat.step_begin()  # ... and never returns
    time.sleep(3 * _heartbeat.BEAT_INTERVAL)
    progress = read_progress(str(path))
    assert (progress.begun, progress.ended, progress.in_step) == (6, 5, True)


def test_done_is_never_overwritten_by_a_later_count(heartbeat):
    path, _ = heartbeat
    _heartbeat.step_begin()
    _heartbeat.step_end()
    _heartbeat.mark_finished()
    _heartbeat.step_begin()
    time.sleep(3 * _heartbeat.BEAT_INTERVAL)
    assert path.read_text().split()[2] == "done"
    _heartbeat.mark_failed()  # a failure after it still says so
    assert path.read_text().split()[2].startswith("failed:")
