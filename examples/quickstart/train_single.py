"""The seeds' single-card script in JAX: LinearNet, MSE, Adam, 20 steps."""

import jax
import numpy as np
import optax
from flax import nnx


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
    layer = LinearNet(nnx.Rngs(0))
    adam = nnx.Optimizer(layer, optax.adam(learning_rate=0.001), wrt=nnx.Param)
    step = nnx.jit(train_step)
    rng = np.random.RandomState(0)
    for i in range(20):
        inputs = rng.randn(16, 10).astype(np.float32)
        labels = rng.randn(16, 1).astype(np.float32)
        loss = step(layer, adam, inputs, labels)
        print(f"step:{i}\tloss:{float(loss):.6f}")
    print(f"devices: {jax.device_count()}")


if __name__ == "__main__":
    main()
