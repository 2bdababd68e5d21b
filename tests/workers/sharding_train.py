"""A fleetrun worker for strategy.sharding (issue 13).

``python sharding_train.py OUT CKPT``: trains the CNN (NNX, stage 1), the
Linen CNN (TrainState, stage 2) and the CNN at stage 3 (issue 37) with Adam,
each process feeding its own rows of the global batch, saves the NNX model
and optimizer to CKPT (the logical layout), and rank 0 writes parameters, the
logical optimizer state and losses to OUT (.npz). The test runs :func:`train` in one process on 4 devices and
compares, then restores CKPT there.
"""

import os
import sys

import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet  # noqa: E402
from fleet.checkpoint import CheckpointManager  # noqa: E402
from fleet.checkpoint._state import Part  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 8, 16


def strategy(stage: int) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": stage}
    return s


def train(rows=lambda x: x, checkpoint=None, init=lambda s: None) -> dict:
    """Both runs on the current devices; ``rows`` picks this process's rows,
    ``init(strategy)`` re-initialises fleet with a strategy."""
    data = models.batches("cnn", STEPS, BATCH)
    init(strategy(1))
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(
        nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    losses = [step(model, optimizer, rows(x), rows(y)) for x, y in data]
    assert optimizer.sharded
    assert fleet.check_replicas(model) == []
    out = {"p" + k: v for k, v in models.flat_params(model).items()}
    out.update({"o" + k: np.asarray(v)
                for k, v in Part.of("optimizer", optimizer).leaves.items()})
    out["losses"] = np.asarray([float(loss) for loss in losses])
    if checkpoint is not None:
        with CheckpointManager(checkpoint) as manager:
            manager.save(STEPS, model=model, optimizer=optimizer)

    init(strategy(2))
    module = models.LinenCNN()
    params = models.linen_init("cnn", data)["params"]
    state = TrainState.create(apply_fn=fleet.distributed_model(module).apply, params=params,
                              tx=fleet.distributed_optimizer(optax.adam(1e-2)))
    linen_step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = linen_step(state, rows(x), rows(y))
    out.update({"l" + k: v for k, v in models.flat_params(state.params).items()})

    init(strategy(3))
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(
        nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in data:
        step(model, optimizer, rows(x), rows(y))
    assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    out.update({"s" + k: v for k, v in models.flat_params(model).items()})
    return out


def main(out_path, checkpoint):
    def init(s):
        fleet.init(is_collective=True, strategy=s)

    init(strategy(1))
    result = train(lambda x: np.array_split(x, fleet.worker_num())[fleet.worker_index()],
                   checkpoint=checkpoint, init=init)
    if fleet.is_first_worker():
        np.savez(out_path, **result)
    fleet.barrier_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
