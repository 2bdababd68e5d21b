"""Asynchronous saves and the Python they run on (issue 35): CPython 3.12.0 to
3.12.2 start no thread once the interpreter exits (CPython gh-113964, fixed in
3.12.3), and orbax finishes a save in new threads, so a save pending at exit
could not be finished there. ``CheckpointManager()`` saves synchronously on
those versions, and ``async_save=True`` raises, rather than a checkpoint being
lost at exit. The exit guarantee itself: tests/test_checkpoint_faults.py
(test_a_pending_save_completes_at_exit runs on every Python)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fleet.checkpoint import CheckpointManager, FleetCheckpointError, _pending

ROOT = Path(__file__).parent.parent


def test_the_versions_are_cpythons_3_12_0_to_3_12_2():
    broken = sys.implementation.name == "cpython" and (3, 12, 0) <= sys.version_info[:3] <= (3, 12, 2)
    assert _pending.FINISHES_AT_EXIT is not broken


EXIT_THREAD = textwrap.dedent("""
    import threading
    from fleet import _compat

    def start_a_thread():  # what orbax does to finish a save (asyncio.to_thread)
        try:
            thread = threading.Thread(target=print, args=("started",))
            thread.start()
            thread.join()
        except RuntimeError as e:
            print("refused:", e)

    _compat.register_before_exit(start_a_thread)  # the hook of fleet's pending saves
""")


def test_this_python_starts_a_thread_at_exit_as_the_check_says():
    """The version check against the behaviour it stands for."""
    done = subprocess.run([sys.executable, "-c", EXIT_THREAD], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("started" if _pending.FINISHES_AT_EXIT else
                                   "refused: can't create new thread at interpreter shutdown")


@pytest.mark.parametrize("finishes, default", [(True, True), (False, False)])
def test_the_default_is_asynchronous_where_a_save_can_finish_at_exit(
        make_world, tmp_path, monkeypatch, finishes, default):
    make_world(1)
    monkeypatch.setattr(_pending, "FINISHES_AT_EXIT", finishes)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.async_save is default
        manager.save(1, state={"w": np.arange(4.0)})
        if not default:  # committed when save returns: nothing pending at exit
            assert manager.all_steps() == [1] and not _pending._IN_FLIGHT
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        assert manager.async_save is False


def test_async_save_true_raises_where_a_save_cannot_finish_at_exit(make_world, tmp_path,
                                                                    monkeypatch):
    make_world(1)
    monkeypatch.setattr(_pending, "FINISHES_AT_EXIT", False)
    version = ".".join(map(str, sys.version_info[:3]))
    with pytest.raises(FleetCheckpointError, match=(
            rf"CheckpointManager\(async_save=True\) on Python {version}: CPython 3\.12\.0 to "
            r"3\.12\.2 start no thread once the interpreter exits, so a save still being written "
            r"then would be lost; use Python 3\.12\.3 or later \(or 3\.11, 3\.13\), or leave "
            r"async_save out")):
        CheckpointManager(tmp_path / "ckpt", async_save=True)
    assert not (tmp_path / "ckpt" / ".fleet-lock").exists()  # raised before taking the directory
