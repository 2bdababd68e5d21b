"""The same script, data-parallel on every device: four changes, marked below."""

import jax
import numpy as np
import optax
from flax import nnx

import fleet  # 1. import fleet


class LinearNet(nnx.Module):
    def __init__(self, rngs):
        self._linear1 = nnx.Linear(10, 10, rngs=rngs)
        self._linear2 = nnx.Linear(10, 1, rngs=rngs)

    def __call__(self, x):
        return self._linear2(self._linear1(x))


def train_step(model, optimizer, inputs, labels):
    def loss_fn(model):
        return ((model(inputs) - labels) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main():
    fleet.init(is_collective=True)  # 2. initialise the data-parallel world
    layer = LinearNet(nnx.Rngs(0))
    adam = nnx.Optimizer(layer, optax.adam(learning_rate=0.001), wrt=nnx.Param)
    layer = fleet.distributed_model(layer)  # 3. wrap the model and the optimizer
    adam = fleet.distributed_optimizer(adam)
    step = fleet.distributed_step(train_step)  # 4. instead of nnx.jit
    rng = np.random.RandomState(0)
    # With several processes (fleetrun), each feeds its own rows of the global batch;
    # fleet.io.DistributedBatchSampler does this for a dataset.
    rows = np.array_split(np.arange(16), fleet.worker_num())[fleet.worker_index()]
    for i in range(20):
        inputs = rng.randn(16, 10).astype(np.float32)  # the global batch
        labels = rng.randn(16, 1).astype(np.float32)
        loss = step(layer, adam, inputs[rows], labels[rows])
        if fleet.is_first_worker():
            print(f"step:{i}\tloss:{float(loss):.6f}")
    if fleet.is_first_worker():
        print(f"devices: {jax.device_count()}")


if __name__ == "__main__":
    main()
