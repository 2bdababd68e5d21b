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
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402

import jax  # noqa: E402
from _steps import MLP, CifarCNN, batch_of, make_fleet, use  # noqa: E402
from flax import nnx  # noqa: E402

import fleet  # noqa: E402

MODELS = {"cnn": (CifarCNN, (32, 32, 3), 128),
          "mlp": (functools.partial(MLP, (2048,) * 7 + (10,)), (2048,), 256)}


def variant(every: int, x, y):
    make, _, _ = MODELS[args.model]
    run = make_fleet(make, x, y, fleet.DistributedStrategy(check_replicas_every_n_steps=every))
    jax.block_until_ready(run())  # compile
    return run


def main():
    _, shape, batch = MODELS[args.model]
    x, y = batch_of(shape, batch)
    variants = {"off": variant(0, x, y), "every step": variant(1, x, y)}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            use(run)  # this variant's strategy again
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)
    model = variants["off"].parts[1]
    nparams = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    step = statistics.median(times["off"])
    check = statistics.median(a - b for a, b in zip(times["every step"], times["off"]))
    print(f"{args.model}: {nparams / 1e6:.2f}M parameters, Adam, global batch {batch}, "
          f"4 x cpu, {args.rounds} rounds x {args.steps} steps "
          f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"step, no check: {step * 1e3:.2f} ms; every step: "
          f"{statistics.median(times['every step']) * 1e3:.2f} ms; "
          f"one check: {check * 1e3:.2f} ms ({check / step:.1%} of a step)")
    print("  (no check, every step: the medians over rounds; one check: the median over "
          "rounds of every step - no check in the same round, so it need not equal the "
          "difference of the two medians)")
    for n in (1, 10, 100, 500):
        print(f"  a check every {n:4d} steps adds {check / step / n:7.3%} per step")


if __name__ == "__main__":
    main()
