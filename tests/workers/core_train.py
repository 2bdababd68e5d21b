"""A worker of the launcher-free multi-process test: LinearNet on the seeds' data.

Reads the FLEET_* environment like any worker, trains STEPS steps on its own
rows of each global batch, and (rank 0) writes the parameters and losses to
the .npz named on the command line.
"""

import os
import sys

import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 10, 16


def main(out_path: str) -> None:
    fleet.init(is_collective=True)
    assert fleet.worker_num() == int(os.environ["FLEET_WORLD_SIZE"])
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
