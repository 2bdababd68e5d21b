"""Benchmark: the host time of one step call, fleet against a hand-written step.

A tiny model (a 16 -> 16 -> 1 MLP, 16 rows per step) with SGD on 4 CPU
devices, so that compute is negligible and the time per call is the host's:
Python, tree flattening, dispatch. Two variants, run interleaved, round after
round, each timing ``--calls`` calls after warm-up:

* ``hand``: ``jax.jit(jax.shard_map(step))`` written by hand on the split state
  (``nnx.split``), the batch already sharded over ``data``, the state donated;
* ``fleet``: ``fleet.distributed_step`` with the model and optimizer objects and
  the same sharded batch.

Each call's result is waited for (``block_until_ready``) only at the end of a
round. The table shows the median µs per call and the median per-round ratio
fleet / hand.

    .venv/bin/python benchmarks/host_cost.py [--rounds 15] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument("--calls", type=int, default=200)
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fleet  # noqa: E402


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(16, 16, rngs=rngs)
        self.b = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def main() -> None:
    fleet.init(is_collective=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((16, 16), np.float32), rows)
    y = jax.device_put(rng.standard_normal((16, 1), np.float32), rows)
    tx = optax.sgd(1e-3)

    # hand-written: split state, jit(shard_map), donated
    model = Tiny(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

    def body(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    hand = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                 out_specs=(P(), P(), P())), donate_argnums=(0, 1))
    state = [params, opt_state]

    def run_hand():
        state[0], state[1], loss = hand(state[0], state[1], x, y)
        return loss

    # fleet
    fmodel = fleet.distributed_model(Tiny(nnx.Rngs(0)))
    fopt = fleet.distributed_optimizer(nnx.Optimizer(fmodel, tx, wrt=nnx.Param))

    @fleet.distributed_step
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    def run_fleet():
        return step(fmodel, fopt, x, y)

    variants = {"hand": run_hand, "fleet": run_fleet}
    for run in variants.values():  # compile and warm up
        for _ in range(20):
            out = run()
        jax.block_until_ready(out)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                out = run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    ratios = [f / h for f, h in zip(times["fleet"], times["hand"])]
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {args.rounds} rounds of "
          f"{args.calls} calls")
    for name in variants:
        print(f"  {name:6s} {statistics.median(times[name]):8.1f} µs per call")
    print(f"  fleet / hand (median of per-round ratios): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
