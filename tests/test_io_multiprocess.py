"""Acceptance 7 with several processes: fleetrun starts 2 processes x 2 CPU devices.

Each process loads its share through the DataLoader; the test checks every
device's rows against the single-replica samplers and that exact evaluation sees
each sample once, on every process.
"""

import json
import textwrap

import numpy as np
import pytest

from fleet.io import DistributedBatchSampler
from tests.fleetrun_jobs import Jobs

N, BATCH, PROCESSES, LOCAL = 37, 2, 2, 2

WORKER = textwrap.dedent(f"""
    import json
    import numpy as np
    import fleet
    world = fleet.init(is_collective=True)
    import jax
    from fleet.io import DataLoader, TensorDataset

    x = np.arange({N} * 2, dtype=np.float32).reshape({N}, 2)
    loader = DataLoader(TensorDataset([x, np.arange({N})]), batch_size={BATCH}, shuffle=True)
    out = {{"mesh_ids": [d.id for d in world.mesh.devices.flat], "steps": [], "seen": []}}
    for epoch in range(2):
        for xb, yb in loader:
            assert xb.sharding == world.batch and yb.sharding == world.batch
            assert xb.shape == (yb.shape[0], 2)
            out["steps"].append({{
                "epoch": epoch,
                "shape": list(yb.shape),
                "shards": {{str(s.device.id): np.asarray(s.data).tolist()
                           for s in yb.addressable_shards}},
                "x_ok": all(np.array_equal(np.asarray(s.data), x[np.asarray(t.data)])
                            for s, t in zip(xb.addressable_shards, yb.addressable_shards)),
            }})
            out["seen"] += loader.gather_for_metrics(yb).tolist()
    print("RESULT" + json.dumps(out), flush=True)
""")




@pytest.fixture
def run_job(tmp_path):
    jobs = Jobs(tmp_path)

    def run():
        _, logs = jobs.run(WORKER, PROCESSES, LOCAL, "io-test")
        return [json.loads(log.split("RESULT", 1)[1].splitlines()[0]) for log in logs]

    yield run
    jobs.close()


def test_each_device_of_each_process_gets_its_replica_batch(run_job):
    results = run_job()
    replicas = PROCESSES * LOCAL
    mesh_ids = results[0]["mesh_ids"]
    assert all(r["mesh_ids"] == mesh_ids for r in results)
    samplers = [DistributedBatchSampler(range(N), BATCH, num_replicas=replicas, rank=r,
                                        shuffle=True) for r in range(replicas)]
    want = [step for _ in range(2) for step in zip(*[list(s) for s in samplers])]
    for process, result in enumerate(results):
        assert len(result["steps"]) == len(want)
        for got, per_replica in zip(result["steps"], want):
            assert got["shape"] == [sum(len(b) for b in per_replica)]
            assert got["x_ok"]
            mine = range(process * LOCAL, (process + 1) * LOCAL)  # replica = mesh position
            assert got["shards"] == {str(mesh_ids[r]): per_replica[r] for r in mine}
        # Exact evaluation across processes: every sample once per epoch, on every process.
        seen = np.array(result["seen"]).reshape(2, N)
        assert [sorted(epoch) for epoch in seen.tolist()] == [list(range(N))] * 2
