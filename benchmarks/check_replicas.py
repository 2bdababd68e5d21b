"""Benchmark: what ``strategy.check_replicas_every_n_steps`` costs per check.

The seed's CIFAR-10 CNN (examples/cifar10, 0.12M parameters) with Adam, global
batch 128, on 4 CPU devices (``--model mlp``: the 25M-parameter MLP of
benchmarks/strategy.py, global batch 256). Two variants, a fresh world and
model each, run interleaved round after round, each timing ``--steps`` steps:

* ``off``: ``check_replicas_every_n_steps = 0`` (the default);
* ``every step``: ``check_replicas_every_n_steps = 1``: after each step every
  device's copy of the parameters, the optimizer state and the outputs is read
  back and compared (the host waits for the step).

The extra time of ``every step`` over ``off`` is the cost of one check; the
table gives it, and what a check every N steps would add to a step (median
per-round figures).

    .venv/bin/python benchmarks/check_replicas.py [--rounds 5] [--steps 10] [--model cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "cifar10"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from train import MyNet  # noqa: E402  (the seed's CNN)

import fleet  # noqa: E402
from fleet import _world  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(2048, 2048, rngs=rngs) for _ in range(6)])
        self.head = nnx.Linear(2048, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


MODELS = {"cnn": (MyNet, (32, 32, 3), 128), "mlp": (MLP, (2048,), 256)}


def train_step(model, optimizer, x, y):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def variant(every: int, x, y):
    make, _, _ = MODELS[args.model]
    _world._WORLD = None
    strategy = fleet.DistributedStrategy(check_replicas_every_n_steps=every)
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(make(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    step = fleet.distributed_step(train_step)
    xs, ys = jax.device_put(x, fleet.world().batch), jax.device_put(y, fleet.world().batch)
    jax.block_until_ready(step(model, optimizer, xs, ys))  # compile
    return strategy, lambda: step(model, optimizer, xs, ys), (model, optimizer)


def main():
    _, shape, batch = MODELS[args.model]
    rng = np.random.RandomState(0)
    x = rng.randn(batch, *shape).astype(np.float32)
    y = rng.randint(0, 10, batch).astype(np.int32)
    variants = {"off": variant(0, x, y), "every step": variant(1, x, y)}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (strategy, run, _) in variants.items():
            fleet.init(is_collective=True, strategy=strategy)  # this variant's world again
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)
    model, _ = variants["off"][2]
    nparams = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    step = statistics.median(times["off"])
    check = statistics.median(a - b for a, b in zip(times["every step"], times["off"]))
    print(f"{args.model}: {nparams / 1e6:.2f}M parameters, Adam, global batch {batch}, "
          f"4 x cpu, {args.rounds} rounds x {args.steps} steps "
          f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"step, no check: {step * 1e3:.2f} ms; every step: "
          f"{statistics.median(times['every step']) * 1e3:.2f} ms; "
          f"one check: {check * 1e3:.2f} ms ({check / step:.1%} of a step)")
    for n in (1, 10, 100, 500):
        print(f"  a check every {n:4d} steps adds {check / step / n:7.3%} per step")


if __name__ == "__main__":
    main()
