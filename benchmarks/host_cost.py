"""Benchmark: the host's cost of one step call, and whether calls wait for the
device, fleet against hand-written JAX (issue 24, items 2 and 3).

A tiny model (a 16 -> 16 -> 1 MLP, SGD, 16 rows per step) on 4 CPU devices,
so that the host's work per call (Python, tree flattening, dispatch) is what is
measured. Variants run interleaved, round after round; in each round a variant
makes ``--calls`` calls without waiting, then its results are waited for
(untimed), so every round starts with the device idle.

Host cost per call (item 2): the CPU time of the calling thread
(``time.thread_time``) per call: what the host spends, without the time it
waits or is preempted by the CPU devices' own threads (on a GPU those run
elsewhere). Baselines, written as a JAX user would:

* ``hand``: ``jax.jit(jax.shard_map(step))`` on ``nnx.split`` state, the state
  donated, the batch already sharded over ``data``;
* ``hand, numpy batch``: the same ``jax.jit`` given numpy rows, placed by its
  ``in_shardings``.

fleet: ``fleet.distributed_step`` with the model and optimizer objects and the
same batch (sharded, or numpy).

Dispatch (item 3): the wall time of the ``--calls`` calls, against ``jax.jit``
of the single-device step (batch sharded over ``data``, parameters replicated
and donated: XLA's partitioner inserts the all-reduce): fleet's default, and
with ``check_nan_inf``. A call that waited for the device would take about
the device's time per step (``done`` column, per call) instead of the host's.
``--calls`` stays under 32: JAX's CPU client runs at most 32 programs in flight
per device and then waits, which would measure the device.

Every column is the median over rounds; each ratio is the ratio of the two
medians printed beside it.

    .venv/bin/python benchmarks/host_cost.py [--rounds 60] [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--rounds", type=int, default=60)
parser.add_argument("--calls", type=int, default=20)
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _steps import use  # noqa: E402
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


TX = optax.sgd(1e-3)


def hand_steps(mesh, x, y):
    """The hand-written ``jit(shard_map)`` step on split state: one run function
    per batch form (sharded, numpy)."""
    graphdef, params = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def body(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                           out_specs=(P(), P(), P()))
    step = jax.jit(mapped, donate_argnums=(0, 1),
                   in_shardings=(replicated, replicated, rows, rows))
    params = jax.device_put(params, replicated)
    state = [params, jax.device_put(TX.init(params), replicated)]
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)

    def run(x, y):
        state[0], state[1], loss = step(state[0], state[1], x, y)
        return loss

    return (lambda: run(xs, ys)), (lambda: run(x, y))


def plain_jit(mesh, x, y):
    """``jax.jit`` of the single-device step, batch sharded, parameters replicated."""
    graphdef, params = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def single(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(single, donate_argnums=(0, 1),
                   out_shardings=(replicated, replicated, replicated))
    params = jax.device_put(params, replicated)
    state = [params, jax.device_put(TX.init(params), replicated)]
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)

    def run():
        state[0], state[1], loss = step(state[0], state[1], xs, ys)
        return loss

    return run


def fleet_steps(strategy, x, y):
    """fleet's step: one run function per batch form (sharded, numpy)."""
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(Tiny(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, TX, wrt=nnx.Param))

    @fleet.distributed_step
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    w = fleet.world()
    xs, ys = jax.device_put(x, w.batch), jax.device_put(y, w.batch)
    sharded, numpy = (lambda: step(model, optimizer, xs, ys)), (lambda: step(model, optimizer, x, y))
    sharded.strategy = numpy.strategy = strategy  # (see _steps.use)
    return sharded, numpy


def measure(variants: dict) -> tuple[dict, dict, dict]:
    """Median over rounds of the calling thread's CPU time per call, the wall time
    per call, and the wall time per call until the results are ready (µs)."""
    for run in variants.values():  # compile and warm up
        use(run)
        for _ in range(args.calls):
            out = run()
        jax.block_until_ready(out)
    cpu: dict = {k: [] for k in variants}
    wall: dict = {k: [] for k in variants}
    done: dict = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            use(run)
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.calls):
                out = run()
            cpu[name].append((time.thread_time() - start_cpu) / args.calls * 1e6)
            wall[name].append((time.perf_counter() - start) / args.calls * 1e6)
            jax.block_until_ready(out)
            done[name].append((time.perf_counter() - start) / args.calls * 1e6)
    return tuple({k: statistics.median(v) for k, v in d.items()} for d in (cpu, wall, done))


def main() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 16), np.float32)
    y = rng.standard_normal((16, 1), np.float32)
    hand_sharded, hand_numpy = hand_steps(mesh, x, y)
    fleet_sharded, fleet_numpy = fleet_steps(fleet.DistributedStrategy(), x, y)
    nan_sharded, _ = fleet_steps(fleet.DistributedStrategy(check_nan_inf=True), x, y)
    variants = {
        "hand": hand_sharded, "fleet": fleet_sharded,
        "hand, numpy batch": hand_numpy, "fleet, numpy batch": fleet_numpy,
        "jax.jit": plain_jit(mesh, x, y), "fleet, check_nan_inf": nan_sharded,
    }
    cpu, wall, done = measure(variants)
    load = os.getloadavg()[0]
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {args.rounds} rounds of "
          f"{args.calls} calls, load average {load:.1f}")
    print("\nhost cost per call (CPU time of the calling thread, µs)")
    print(f"{'variant':22s} {'µs/call':>8s} {'vs hand':>8s}")
    for name, base in (("hand", None), ("fleet", "hand"), ("hand, numpy batch", None),
                       ("fleet, numpy batch", "hand, numpy batch")):
        ratio = f"{cpu[name] / cpu[base]:8.2f}" if base else ""
        print(f"{name:22s} {cpu[name]:8.1f} {ratio}")
    print(f"\ndispatch: {args.calls} calls without waiting (wall time per call, µs)")
    print(f"{'variant':22s} {'dispatch':>9s} {'vs jax.jit':>11s} {'cpu':>7s} {'done':>8s}")
    for name in ("jax.jit", "fleet", "fleet, check_nan_inf"):
        ratio = "" if name == "jax.jit" else f"{wall[name] / wall['jax.jit']:11.2f}"
        print(f"{name:22s} {wall[name]:9.1f} {ratio:>11s} {cpu[name]:7.1f} {done[name]:8.1f}")


if __name__ == "__main__":
    main()
