"""Models that differ across processes are refused on every process (2 processes
x 2 CPU devices through fleetrun). That two processes train what one device
trains is checked in the one job of tests/test_two_processes.py."""

from pathlib import Path

import pytest

from tests import jobs
from tests.tiers import slow
from tests.workers import core_train

pytestmark = slow  # a multi-process fault case


@pytest.mark.parametrize("mode", ["mismatch", "mismatch-slow"])
def test_models_that_differ_across_processes_are_refused(tmp_path, mode):
    """Every process's log holds its own error; "mismatch-slow": process 1 prints
    its error 3 s late, and process 0's exit (which takes JAX's key-value service
    down, and JAX then aborts process 1) waits for it (a race CI lost once)."""
    job = jobs.two_processes(tmp_path, Path(core_train.__file__), mode, ok=False)
    assert job.returncode != 0
    for log in job.logs(2):
        assert ("parameter 'layers.0.bias' differs in shape or dtype between process 0 and "
                "process 1 (here: shape (1") in log, log
