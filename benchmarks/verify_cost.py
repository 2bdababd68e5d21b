"""Benchmark: what ``strategy.verify_steps`` costs a verified call.

The MLP (2.1M parameters) and the CIFAR-10 CNN of ``benchmarks/step_overhead.py``,
Adam, on 4 CPU devices (or the local GPUs with ``--platform gpu``): the median
ms of a plain call, of a verified call once the single-device reference is
compiled, and the first verified call (which compiles the reference), plus the
bytes a verified call copies onto one device (state and global batch, twice:
plain and perturbed).

    .venv/bin/python benchmarks/verify_cost.py [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--devices", type=int, default=4, help="CPU devices to fake (CPU only)")
parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

if args.platform == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import io  # noqa: E402

import jax  # noqa: E402
from _steps import batch_of, make_fleet  # noqa: E402
from flax import nnx  # noqa: E402
from step_overhead import MODELS  # noqa: E402  (its argparse reads ours: same flags)

import fleet  # noqa: E402


def timed(run, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(run())
        out.append((time.perf_counter() - t) * 1e3)
    return out


def measure(name: str) -> None:
    make, shape, batch = MODELS[name]
    x, y = batch_of(shape, batch)
    plain = make_fleet(make, x, y, fleet.DistributedStrategy())
    timed(plain, 3)
    plain_ms = statistics.median(timed(plain, args.steps))
    verified = make_fleet(make, x, y, fleet.DistributedStrategy(verify_steps=10 ** 6))
    with contextlib.redirect_stderr(io.StringIO()):  # one line per verified call
        first = timed(verified, 1)[0]
        verified_ms = statistics.median(timed(verified, args.steps))
    _, model, optimizer, _, _ = verified.parts
    state = sum(v.nbytes for v in jax.tree.leaves(nnx.state((model, optimizer))))
    copied = 2 * (state + x.nbytes + y.nbytes)
    print(f"{name}: plain {plain_ms:.1f} ms, verified {verified_ms:.1f} ms "
          f"(x{verified_ms / plain_ms:.1f}), first verified call {first:.0f} ms (compiles "
          f"the reference); copies {copied / 2**20:.1f} MiB onto one device "
          f"(state {state / 2**20:.1f} MiB + batch {(x.nbytes + y.nbytes) / 2**20:.1f} MiB, x2)")


if __name__ == "__main__":
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices", file=sys.stderr)
    for name in ("mlp", "cnn"):
        measure(name)
