"""Benchmark: fleet's step against the best hand-written JAX steps, side by side.

Two models -- an MLP of 2.1M parameters and the seed's CIFAR-10 CNN -- with
Adam, on 4 CPU devices (or the local GPUs with ``--platform gpu``). Baselines:

* (a) jit + shard_map, hand-written: replicated parameters, gradients summed by
  shard_map's transpose and divided by N;
* (b) plain ``jax.jit`` of the single-device step, the batch sharded over
  ``data`` and the parameters replicated (XLA's partitioner inserts the
  all-reduce).

fleet runs with its defaults, 1 MB buckets, fusion off, and ``check_nan_inf``
(which selects the state on the device and reads its chain back without
waiting, fleet/sections/_finite.py); each variant's strategy is made the world's again
before its rounds (a step reads the world's strategy). Every variant donates
its parameters and optimizer state (fleet by default). Variants run
interleaved, round after round, each timing ``--steps`` steps; the table shows
the median ms per step and the median of the per-round ratios against each
baseline and against the faster of the two. While it runs (minutes on CPU), a
line on stderr names each compilation and each round.

    .venv/bin/python benchmarks/step_overhead.py [--rounds 10] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--devices", type=int, default=4, help="CPU devices to fake (CPU only)")
parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
parser.add_argument("--rounds", type=int, default=10)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
args = parser.parse_args()

if args.platform == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _steps import MLP, CifarCNN, batch_of, make_fleet, make_plain_jit, make_shard_map, use  # noqa: E402
from flax import nnx  # noqa: E402

import fleet  # noqa: E402

SIZES = (784, 1024, 1024, 256, 10)  # 2.1M parameters
MODELS = {  # name -> (constructor, input shape per example, global batch)
    "mlp": (functools.partial(MLP, SIZES), (SIZES[0],), 256),
    "cnn": (CifarCNN, (32, 32, 3), 128),
}


def progress(what: str, began: float) -> None:
    """A line on stderr, so that the minutes before the table are not silent."""
    print(f"  ... {what}, {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)


def measure(name: str) -> None:
    make, shape, batch = MODELS[name]
    x, y = batch_of(shape, batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    variants = {
        "(a) jit+shard_map, by hand": make_shard_map(make, x, y, mesh),
        "(b) plain jax.jit, sharded batch": make_plain_jit(make, x, y, mesh),
        "fleet, default": make_fleet(make, x, y, fleet.DistributedStrategy()),
        "fleet, 1 MB buckets": make_fleet(make, x, y, fleet.DistributedStrategy(
            fuse_grad_size_in_MB=1)),
        "fleet, fusion off": make_fleet(make, x, y, fleet.DistributedStrategy(
            fuse_all_reduce_ops=False)),
        "fleet, check_nan_inf": make_fleet(make, x, y, fleet.DistributedStrategy(
            check_nan_inf=True)),
    }
    began = time.perf_counter()
    for i, (v, run) in enumerate(variants.items()):  # compile and warm up
        progress(f"{name}: compiling {i + 1}/{len(variants)} {v}", began)
        use(run)
        for _ in range(3):
            run()
        jax.block_until_ready(run())
    times = {v: [] for v in variants}
    for r in range(args.rounds):
        progress(f"{name}: round {r + 1}/{args.rounds} ({len(variants)} variants x "
                 f"{args.steps} steps)", began)
        for v, run in variants.items():
            use(run)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = run()
            jax.block_until_ready(out)
            times[v].append((time.perf_counter() - t0) / args.steps)
    a = np.array(times["(a) jit+shard_map, by hand"])
    b = np.array(times["(b) plain jax.jit, sharded batch"])
    best = np.minimum(a, b)
    nparams = sum(p.size for p in jax.tree.leaves(nnx.state(make(nnx.Rngs(0)), nnx.Param)))
    devices = f"{jax.device_count()} x {jax.devices()[0].platform}"
    print(f"\n{name}: {nparams / 1e6:.2f}M parameters, Adam, global batch {batch}, {devices}, "
          f"{args.rounds} rounds x {args.steps} steps (jax {jax.__version__})")
    print(f"{'variant':34s} {'ms/step':>8s} {'vs (a)':>7s} {'vs (b)':>7s} {'vs best':>8s} "
          f"{'rounds':>13s}")
    outside = []
    for v, t in times.items():
        t = np.array(t)
        ratios = t / best
        print(f"{v:34s} {np.median(t) * 1e3:8.2f} {np.median(t / a):7.3f} "
              f"{np.median(t / b):7.3f} {np.median(ratios):8.3f} "
              f"{ratios.min():6.3f}-{ratios.max():<6.3f}")
        of_medians = np.median(t) / np.median(best)
        if not ratios.min() <= of_medians <= ratios.max():
            outside.append(f"{v} {of_medians:.3f}")
    print("  (ms/step: the median over rounds; vs (a), vs (b), vs best: the median over "
          "rounds of the variant's ms / the baseline's in the same round (each round times "
          "every variant back to back, so a load that moves between rounds cancels in a "
          "ratio, not in the ms column); rounds: vs best's lowest-highest)")
    if outside:
        print(f"  (the ratio of the ms medians falls outside the rounds' range: "
              f"{', '.join(outside)}; the load changed during the run, so trust no ratio here)")


def main():
    for name in args.models.split(","):
        measure(name)


if __name__ == "__main__":
    main()
