"""A fleetrun worker for the composed strategy (issue 12, acceptance 7).

``python strategy_train.py OUT``: trains the CNN with amp (bf16), recompute,
gradient_merge (k=2), LAMB and fp16_allreduce in one strategy, one call inside
``no_sync``, each process feeding its own rows of the global batch; rank 0
writes parameters, optimizer state and losses to OUT (.npz). The test runs
:func:`train` in one process on the same global batches and compares.
"""

import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH, NO_SYNC_CALLS = 8, 16, (4,)


def strategy() -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.amp = True
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["conv1", "conv2"]}
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2, "avg": True}
    s.lamb = True
    s.lamb_configs = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["bias"]}
    s.fp16_allreduce = True
    return s


def train(rows=lambda x: x) -> dict:
    """The composed run on the current fleet world; ``rows`` picks this process's rows."""
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(
        nnx.Optimizer(model, fleet.optimizer.Adam(learning_rate=1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    losses = []
    for i, (x, y) in enumerate(models.batches("cnn", STEPS, BATCH)):
        if i in NO_SYNC_CALLS:
            with model.no_sync():
                losses.append(step(model, optimizer, rows(x), rows(y)))
        else:
            losses.append(step(model, optimizer, rows(x), rows(y)))
    assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    out = {"p" + k: v for k, v in models.flat_params(model).items()}
    opt_state = nnx.to_pure_dict(nnx.state(optimizer.opt_state))
    out.update({"o" + jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(opt_state)[0]})
    out["losses"] = np.asarray([float(loss) for loss in losses])
    out["optimizer_steps"] = np.asarray(int(optimizer.step[...]))
    return out


def main(out_path):
    fleet.init(is_collective=True, strategy=strategy())
    result = train(lambda x: np.array_split(x, fleet.worker_num())[fleet.worker_index()])
    if fleet.is_first_worker():
        np.savez(out_path, **result)
    fleet.barrier_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
