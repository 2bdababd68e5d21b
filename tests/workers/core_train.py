"""A fleetrun worker: LinearNet on the seeds' data (tests/workers/two_processes.py).

Reads the FLEET_* environment like any worker, trains STEPS steps on its own
rows of each global batch, and (rank 0) writes the parameters and losses to
the .npz named on the command line.
"""

import os
import sys
import time

import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 10, 16


def check_collectives_across_processes() -> None:
    rank, n = fleet.worker_index(), fleet.worker_num()
    assert float(fleet.all_reduce(np.float32(rank + 1))) == n * (n + 1) / 2
    assert float(fleet.all_reduce(np.float32(rank), op="max")) == n - 1
    assert float(fleet.broadcast(np.float32(rank + 7), src=1)) == 8
    np.testing.assert_array_equal(np.asarray(fleet.all_gather(np.float32(rank))), np.arange(n))
    fleet.barrier()


def build_mismatched_model() -> None:
    """Process 1 builds a wider first layer: wrapping must fail on every process."""
    model = nnx.Sequential(nnx.Linear(10, 10 + fleet.worker_index(), rngs=nnx.Rngs(0)))
    fleet.distributed_model(model)


def main(out_path: str) -> None:
    fleet.init(is_collective=True)
    assert fleet.worker_num() == int(os.environ["FLEET_WORLD_SIZE"])
    assert fleet.num_replicas() == 2 * fleet.worker_num()
    if out_path == "mismatch-slow":  # process 1 prints its error 3 s late
        if fleet.worker_index() == 1:
            sys.excepthook = lambda *e: (time.sleep(3), sys.__excepthook__(*e))
        out_path = "mismatch"
    if out_path == "mismatch":
        return build_mismatched_model()
    check_collectives_across_processes()
    model = models.LinearNet(nnx.Rngs(fleet.worker_index()))  # different on purpose
    optimizer = nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param)
    model = fleet.distributed_model(model)  # broadcast from process 0
    optimizer = fleet.distributed_optimizer(optimizer)
    step = fleet.distributed_step(models.nnx_train_step)
    rows = np.array_split(np.arange(BATCH), fleet.worker_num())[fleet.worker_index()]
    losses = [float(step(model, optimizer, x[rows], y[rows]))
              for x, y in models.batches("linear", STEPS, BATCH)]
    params = models.flat_params(model)
    if fleet.is_first_worker():
        np.savez(out_path, losses=np.array(losses), **params)
    fleet.barrier_worker()


if __name__ == "__main__":
    main(sys.argv[1])
