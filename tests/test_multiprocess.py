"""Models that differ across processes are refused on every process (2 processes
x 2 CPU devices through fleetrun). That two processes train what one device
trains is checked in the one job of tests/test_two_processes.py."""

from pathlib import Path

from tests import jobs
from tests.tiers import slow
from tests.workers import core_train

pytestmark = slow  # a multi-process fault case


def test_models_that_differ_across_processes_are_refused(tmp_path):
    job = jobs.two_processes(tmp_path, Path(core_train.__file__), "mismatch", ok=False)
    assert job.returncode != 0
    for log in job.logs(2):
        assert ("parameter 'layers.0.bias' differs in shape or dtype between process 0 and "
                "process 1 (here: shape (1") in log, log
