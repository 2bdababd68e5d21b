"""Bad input to fleet.io, as one table (issue 10).

Each row: what the user does, the error it must raise, and the message (a regular
expression) that says what was given and what to do. The multi-process case (the
processes' datasets differ in length) is a real ``fleetrun`` job that must end by
itself within 60 s, with the message checked on every process.
"""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fleet
from fleet.io import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedBatchSampler,
    FleetDataError,
    TensorDataset,
)
from tests import jobs
from tests.tiers import slow


class Samples(Dataset):
    """Eight samples; ``bad(i)`` makes sample ``i`` (module level: workers unpickle it)."""

    def __init__(self, kind: str, length: int = 8):
        self.kind, self.length = kind, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.kind == "none" and i == 3:
            return None  # a forgotten return on one path
        if self.kind == "object":
            return np.zeros(2, np.float32), Opaque()
        if self.kind == "nested none":
            return {"image": np.zeros(2, np.float32), "label": None}
        if self.kind == "short" and i >= 5:
            raise IndexError(i)  # __len__ says more than __getitem__ serves
        return np.zeros(2, np.float32), np.int32(i)


class Opaque:
    def __repr__(self):
        return "Opaque()"


def load_all(dataset, **kwargs):
    return list(DataLoader(dataset, batch_size=2, **kwargs))


# case: (what the user does, error, message)
CASES = {
    "__getitem__ returns None": (
        lambda: load_all(Samples("none")), FleetDataError,
        r"sample at dataset index 3 is None; make __getitem__ return the sample on every "
        r"path \(a missing `return` gives None\)"),
    "__getitem__ returns None, in a worker": (
        lambda: load_all(Samples("none"), num_workers=1), FleetDataError,
        r"sample at dataset index 3 is None; make __getitem__ return"),
    "a field of the sample is None": (
        lambda: load_all(Samples("nested none")), FleetDataError,
        r"sample at dataset index 0 at \['label'\] is None"),
    "__getitem__ returns an arbitrary object": (
        lambda: load_all(Samples("object")), FleetDataError,
        r"sample at dataset index 0 at \[1\] is a Opaque object \(Opaque\(\)\); numpy cannot "
        r"batch it: convert it to an array or a number in __getitem__, or pass a collate_fn"),
    "__len__ says more than __getitem__ serves (issue 22)": (
        lambda: load_all(Samples("short")), FleetDataError,
        r"Samples\[5\] raised IndexError \(5\), although len\(Samples\) is 8 and the sampler "
        r"asked for index 5 of range\(0, 8\); make __len__ say how many samples"),
    "__len__ says more than __getitem__ serves, in a worker": (
        lambda: load_all(Samples("short"), num_workers=1), FleetDataError,
        r"Samples\[5\] raised IndexError \(5\), although len\(Samples\) is 8"),
    "__len__ < 0, DataLoader": (
        lambda: DataLoader(Samples("ok", length=-3), batch_size=2), fleet.FleetError,
        r"len\(\) of the Samples is -3; __len__ must return the number of samples, an int "
        r">= 0"),
    "__len__ < 0, BatchSampler": (
        lambda: BatchSampler(dataset=Samples("ok", length=-1), batch_size=2), fleet.FleetError,
        r"len\(\) of the Samples is -1; __len__ must return"),
    "drop_last and batch_size > dataset, BatchSampler": (
        lambda: BatchSampler(dataset=range(40), batch_size=64, drop_last=True),
        fleet.FleetError,
        r"BatchSampler\(batch_size=64, drop_last=True\) over 40 samples gives no batch: the "
        r"only batch is partial and drop_last drops it; use batch_size <= 40, or "
        r"drop_last=False"),
    "drop_last and batch_size > a replica's share, DistributedBatchSampler": (
        lambda: DistributedBatchSampler(range(40), 32, num_replicas=2, rank=0, drop_last=True),
        fleet.FleetError,
        r"DistributedBatchSampler\(batch_size=32, drop_last=True\) over 40 samples split over "
        r"2 replicas \(20 each\) gives no batch: .*use batch_size <= 20, or drop_last=False"),
    "drop_last and batch_size > dataset, DataLoader": (
        lambda: DataLoader(TensorDataset([np.zeros((5, 2))]), batch_size=6, drop_last=True),
        fleet.FleetError, r"over 5 samples .*gives no batch"),
}


@pytest.fixture(autouse=True)
def world():
    return fleet.init(is_collective=True)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_a_clear_error(case):
    action, error, message = CASES[case]
    with pytest.raises(error, match=message):
        action()


def test_the_edge_cases_next_to_the_errors_still_work(world):
    """The largest batch drop_last accepts gives one batch; a sample of strings is
    not an object array (strings are gathered into a list)."""
    assert list(BatchSampler(dataset=range(40), batch_size=40, drop_last=True)) == [
        list(range(40))]
    share = DistributedBatchSampler(range(40), 20, num_replicas=2, rank=1, drop_last=True)
    assert list(share) == [list(range(20, 40))]

    class Named(Dataset):
        def __len__(self):
            return world.num_replicas

        def __getitem__(self, i):
            return f"name{i}", np.float32(i)

    names, values = next(iter(DataLoader(Named(), batch_size=1, return_numpy=True)))
    assert names == [f"name{i}" for i in range(world.num_local_replicas)]
    assert values.dtype == np.float32


# -- several processes: datasets of different lengths --------------------------------------

UNEVEN = textwrap.dedent("""
    import numpy as np
    import fleet
    from fleet.io import DataLoader, DistributedBatchSampler, TensorDataset

    fleet.init(is_collective=True)
    n = 40 if fleet.worker_index() == 0 else 44  # each process built "its" dataset
    dataset = TensorDataset([np.arange(n, dtype=np.float32)])
    loader = DataLoader(dataset, batch_sampler=DistributedBatchSampler(dataset, 4))
    step = fleet.distributed_step(lambda x: x.sum())
    for (x,) in loader:
        step(x)
    print("FINISHED", flush=True)
""")


@slow
def test_datasets_of_different_lengths_raise_on_every_process(tmp_path):
    """40 samples on process 0 and 44 on process 1 would give 5 and 6 batches, then hang
    in the step; the samplers compare lengths when they start, and both processes raise."""
    (tmp_path / "worker.py").write_text(UNEVEN)
    job = jobs.two_processes(tmp_path, "worker.py", devices=1, timeout=90, ok=False)
    output, elapsed = job.output, job.seconds
    assert job.returncode != 0, output[-3000:]
    assert elapsed < 60, f"the job ended after {elapsed:.1f} s"
    want = (r"FleetConfigError: DistributedBatchSampler: the processes' datasets differ in "
            r"length \(len\(dataset\) = 40 on process\(es\) \[0\]; len\(dataset\) = 44 on "
            r"process\(es\) \[1\]\); every process must build the same dataset")
    for rank in (0, 1):
        log = job.log(rank)
        assert "FINISHED" not in log and re.search(want, log), log[-3000:]


NO_GUARD = textwrap.dedent("""
    import numpy as np
    import fleet
    from fleet.io import DataLoader, TensorDataset

    def main():
        fleet.init(is_collective=True)
        data = TensorDataset([np.arange(16, dtype=np.float32)])
        for _ in DataLoader(data, batch_size=4, num_workers=2):
            pass
        print("FINISHED", flush=True)

    {call}
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("guarded", [False, pytest.param(True, marks=slow)])
def test_a_script_without_the_main_guard_is_named_before_workers_start(tmp_path, guarded):
    """Issue 22 item 14: spawned workers import the script again; without the guard
    the error names the line and the guard (before: 'worker 0 exited unexpectedly
    with exit code 1 ... Run with num_workers=0'). With it, the loader runs."""
    call = 'if __name__ == "__main__":\n        main()' if guarded else "main()"
    script = tmp_path / "train.py"
    script.write_text(NO_GUARD.format(call=call))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=90, cwd=tmp_path)
    output = done.stdout + done.stderr
    if guarded:
        assert done.returncode == 0 and "FINISHED" in output, output[-3000:]
        return
    assert done.returncode == 1 and "FINISHED" not in output, output[-3000:]
    assert re.search(r"FleetConfigError: DataLoader\(num_workers=2\) is used from line 13 of "
                     r".*train\.py, outside an `if __name__ == \"__main__\":` block\..*"
                     r"spawn.*or use num_workers=0", output), output[-3000:]
    assert "exited unexpectedly" not in output
