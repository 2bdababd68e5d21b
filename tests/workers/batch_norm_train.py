"""A fleetrun worker: tests/test_batch_norm.py's Net with strategy.sync_batch_norm
= True on this process's rows of each global batch. Rank 0 writes the losses and
the state (parameters and running statistics) to the .npz named on the command
line; the test compares them with the single-device run."""

import os
import sys

import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet  # noqa: E402
from tests import test_batch_norm as bn  # noqa: E402


def main(out_path: str) -> None:
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy(sync_batch_norm=True))
    rank, count = fleet.worker_index(), fleet.worker_num()
    model = fleet.distributed_model(bn.Net(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(bn.LR),
                                                          wrt=nnx.Param))
    step = fleet.distributed_step(bn.train_step)
    rows = bn.BATCH // count
    part = slice(rank * rows, (rank + 1) * rows)
    losses = [float(step(model, optimizer, x[part], y[part])) for x, y in bn.data()]
    assert fleet.check_replicas(model) == []
    if fleet.is_first_worker():
        np.savez(out_path, losses=np.array(losses), **bn.state_of(model))


if __name__ == "__main__":
    main(sys.argv[1])
