"""A fleetrun worker for the core contract (issue 9, acceptance 1h and 4).

``python worker.py OUT shapes``: runs step shapes (a) DataParallel + plain
nnx.Optimizer, (b) wrapped Linen + TrainState with plain optax, and (e) Flax's
MNIST split on this job's processes, each process feeding its own rows of the
global batch; rank 0 writes the results to OUT (.npz).

``python worker.py OUT buckets`` / ``... batch``: the program-guard faults: rank 1
uses another ``fuse_grad_size_in_MB``, or feeds another batch shape.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 6, 16


def my_rows(x):
    return np.array_split(x, fleet.worker_num())[fleet.worker_index()]


def shape_a(data):
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in data:
        step(model, optimizer, my_rows(x), my_rows(y))
    assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []
    return {"a" + k: v for k, v in models.flat_params(model).items()}


def shape_b(data):
    model = fleet.distributed_model(models.LinenLinearNet())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(models.LR))
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = step(state, my_rows(x), my_rows(y))
    assert fleet.check_replicas(state) == []
    return {"b" + k: v for k, v in models.flat_params(state.params).items()}


def apply_model(state, images, labels):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        return models.loss_of(logits, labels), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return grads, loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def shape_e(data):
    model = fleet.distributed_model(models.LinenCNN())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    f_apply, f_update = fleet.distributed_step(apply_model), fleet.distributed_step(update_model)
    out = {}
    for i, (x, y) in enumerate(data):
        grads, loss, acc = f_apply(state, my_rows(x), my_rows(y))
        if i == 0:
            out.update({"egrad" + k: v for k, v in models.flat_params(grads).items()})
        state = f_update(state, grads)
    out.update({"e" + k: v for k, v in models.flat_params(state.params).items()})
    return out


def fault(kind):
    strategy = fleet.DistributedStrategy()
    if kind == "buckets" and fleet.worker_index() == 1:
        strategy.fuse_grad_size_in_MB = 16
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    rows = 8 if kind == "batch" and fleet.worker_index() == 1 else 4
    x, y = models.batches("linear", 1, 16)[0]
    step(model, optimizer, x[:rows], y[:rows])
    print("the step ran", flush=True)


def scalar_fault():
    """Rank 0 passes 100.0 as a scalar step argument, rank 1 passes 1.0."""
    fleet.init(is_collective=True)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    step = fleet.distributed_step(lambda m, x, scale: (m(x) * scale).mean())
    x, _ = models.batches("linear", 1, 16)[0]
    step(model, my_rows(x), 100.0 if fleet.worker_index() == 0 else 1.0)
    print("the step ran", flush=True)


def seed_fault():
    """Each process initialises a Linen TrainState from its own seed (raw parameters)."""
    fleet.init(is_collective=True)
    module = models.LinenLinearNet()
    x, y = models.batches("linear", 1, 16)[0]
    params = module.init(jax.random.key(fleet.worker_index()), x[:1])["params"]
    state = TrainState.create(apply_fn=module.apply, params=params,
                              tx=fleet.distributed_optimizer(optax.sgd(0.1)))
    fleet.distributed_step(models.linen_train_step)(state, my_rows(x), my_rows(y))
    print("the step ran", flush=True)


def wrap_on_rank_0_only():
    """`if fleet.is_first_worker(): model = fleet.distributed_model(model)`."""
    fleet.init(is_collective=True)
    if fleet.is_first_worker():
        fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    print("wrapped", flush=True)


def main(out_path, what):
    if what == "rank0-only":
        return wrap_on_rank_0_only()
    if what in ("buckets", "batch"):
        return fault(what)
    if what == "scalar":
        return scalar_fault()
    if what == "seed":
        return seed_fault()
    fleet.init(is_collective=True)
    results = {}
    results.update(shape_a(models.batches("linear", STEPS, BATCH)))
    results.update(shape_b(models.batches("linear", STEPS, BATCH)))
    results.update(shape_e(models.batches("cnn", 3, BATCH)))
    if fleet.is_first_worker():
        np.savez(out_path, **results)
    fleet.barrier_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
