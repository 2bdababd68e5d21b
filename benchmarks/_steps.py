"""What the step benchmarks share: the models, the loss, the batch, the plain
``jax.jit`` baseline and the fleet variant (benchmarks/step_overhead.py,
donation.py, check_replicas.py).

Import it after setting ``XLA_FLAGS`` (it imports jax); the benchmarks put this
folder and the repository root on ``sys.path`` (running ``python
benchmarks/x.py`` puts this folder there already).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "cifar10"))
from train import MyNet as CifarCNN  # noqa: E402, F401  (the seed's CNN, examples/cifar10)

import fleet  # noqa: E402


class MLP(nnx.Module):
    """Linear layers of ``sizes`` with ReLU between them."""

    def __init__(self, sizes: Sequence[int], rngs: nnx.Rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch_of(shape: Sequence[int], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """A global batch of ``batch`` examples of ``shape`` and 10-class labels."""
    rng = np.random.RandomState(0)
    return (rng.randn(batch, *shape).astype(np.float32),
            rng.randint(0, 10, batch).astype(np.int32))


def make_shard_map(make: Callable, x, y, mesh, tx=None) -> Callable:
    """The step by hand: ``jax.jit(jax.shard_map(...))`` on ``nnx.split`` state,
    parameters and optimizer state replicated and donated, Adam unless ``tx``.
    ``run()`` runs it on the batch sharded over ``data``; ``run.numpy()`` on the
    numpy rows, placed by the jit's ``in_shardings``."""
    graphdef, params = nnx.split(make(nnx.Rngs(0)), nnx.Param)
    tx = tx or optax.adam(1e-3)
    n = mesh.devices.size

    def per_device(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p)(x), y))(params)
        grads = jax.tree.map(lambda g: g / n, grads)  # shard_map's transpose summed them
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                      out_specs=(P(), P(), P())),
        donate_argnums=(0, 1), in_shardings=(replicated, replicated, rows, rows),
    )
    state = [jax.device_put(params, replicated), jax.device_put(tx.init(params), replicated)]
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)

    def on(bx, by):
        state[0], state[1], loss = step(state[0], state[1], bx, by)
        return loss

    def run():
        return on(xs, ys)

    run.numpy = lambda: on(x, y)
    return run


def make_plain_jit(make: Callable, x, y, mesh, tx=None) -> Callable:
    """The single-device step under ``jax.jit``, batch sharded over ``data``,
    parameters replicated and donated (XLA's partitioner inserts the all-reduce);
    Adam unless ``tx``."""
    graphdef, params = nnx.split(make(nnx.Rngs(0)), nnx.Param)
    tx = tx or optax.adam(1e-3)

    def single(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p)(x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, P())
    step = jax.jit(single, donate_argnums=(0, 1),
                   out_shardings=(replicated, replicated, replicated))
    state = [jax.device_put(params, replicated), jax.device_put(tx.init(params), replicated)]
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))

    def run():
        state[0], state[1], loss = step(state[0], state[1], xs, ys)
        return loss

    return run


def make_fleet(make: Callable, x, y, strategy, donate: bool = True, tx=None) -> Callable:
    """fleet's four steps with Adam (unless ``tx``) under ``strategy``: a function
    running one step on the placed batch. It carries ``strategy`` (:func:`use`),
    ``numpy()`` (the step on the numpy rows) and ``parts``: (step, model,
    optimizer, placed x, placed y)."""
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(make(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(
        nnx.Optimizer(model, tx or optax.adam(1e-3), wrt=nnx.Param))

    def train(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    step = fleet.distributed_step(train, donate=donate)
    w = fleet.world()
    xs, ys = jax.device_put(x, w.batch), jax.device_put(y, w.batch)

    def run():
        return step(model, optimizer, xs, ys)

    run.strategy = strategy  # a step reads the world's strategy: set before its rounds
    run.numpy = lambda: step(model, optimizer, x, y)
    run.parts = (step, model, optimizer, xs, ys)
    return run


def use(run: Callable) -> None:
    """Makes a fleet variant's strategy the world's again (same devices), untimed."""
    if hasattr(run, "strategy"):
        fleet.init(is_collective=True, strategy=run.strategy)
