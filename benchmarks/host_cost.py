"""Benchmark: the host's cost of one step call, and whether calls wait for the
device, fleet against hand-written JAX (issue 24, items 2 and 3).

A tiny model (a 16 -> 16 -> 10 MLP, SGD, 16 rows per step) on 4 CPU devices,
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
same batch (sharded, or numpy), each variant with a step of its own, as a
training loop passes one kind of batch (a step's fast path, ``fleet.step._recall``,
recalls the kind of its last call: a switch from numpy rows to a placed batch
takes one full call).

Dispatch (item 3): the wall time of the ``--calls`` calls, against ``jax.jit``
of the single-device step (batch sharded over ``data``, parameters replicated
and donated: XLA's partitioner inserts the all-reduce): fleet's default, and
with ``check_nan_inf``. A call that waited for the device would take about
the device's time per step (``done`` column, per call) instead of the host's.
``check_nan_inf`` is also set against ``jax.jit`` of the same step with
``optax.apply_if_finite`` (the check a JAX user writes: non-finite updates
skipped on the device): its step does more work on the device, which on a
machine whose cores the CPU devices share with the host shows in the wall
time too.
``--calls`` stays under 32: JAX's CPU client runs at most 32 programs in flight
per device and then waits, which would measure the device.

A Linen ``TrainState`` step (the same MLP in ``flax.linen``, pytree state) is
then timed the same way in rounds of its own: by hand (``jit(shard_map)``, the
state donated) and with fleet (its fast path decides the TrainState's role
from its leaves at every call).

Every column is the median over rounds; each ratio is the ratio of the two
medians printed beside it.

    .venv/bin/python benchmarks/host_cost.py [--rounds 60] [--calls 20]
"""

from __future__ import annotations

import argparse
import functools
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

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _steps import (  # noqa: E402
    MLP,
    batch_of,
    loss_of,
    make_fleet,
    make_plain_jit,
    make_shard_map,
    use,
)
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fleet  # noqa: E402

SIZES = (16, 16, 10)  # a tiny MLP: compute is negligible
TX = optax.sgd(1e-3)
CHECKED_TX = optax.apply_if_finite(TX, max_consecutive_errors=10**9)


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


class LinenMLP(nn.Module):
    """The tiny MLP in Linen (16 -> 16 -> 10)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(SIZES[2])(nn.relu(nn.Dense(SIZES[1])(x)))


def linen_train(state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: loss_of(state.apply_fn({"params": p}, x), y))(state.params)
    return state.apply_gradients(grads=grads), loss


def linen_variants(x, y, mesh) -> dict:
    """A Linen ``TrainState`` step: by hand (``jit(shard_map)``, the state donated)
    and with fleet (pytree state, never donated), on the batch sharded over ``data``."""
    n = mesh.devices.size
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)

    def per_device(state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: loss_of(state.apply_fn({"params": p}, x), y))(state.params)
        grads = jax.tree.map(lambda g: g / n, grads)  # shard_map's transpose summed them
        return state.apply_gradients(grads=grads), jax.lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P())), donate_argnums=0)
    module = LinenMLP()
    hand_state = [jax.device_put(TrainState.create(
        apply_fn=module.apply, params=module.init(jax.random.key(0), x[:1])["params"], tx=TX),
        replicated)]

    def hand():
        hand_state[0], loss = step(hand_state[0], xs, ys)
        return loss

    wrapped = fleet.distributed_model(LinenMLP())
    fleet_state = [TrainState.create(
        apply_fn=wrapped.apply, params=wrapped.init(jax.random.key(0), x[:1])["params"],
        tx=fleet.distributed_optimizer(TX))]
    fleet_step = fleet.distributed_step(linen_train)

    def with_fleet():
        fleet_state[0], loss = fleet_step(fleet_state[0], xs, ys)
        return loss

    with_fleet.strategy = fleet.DistributedStrategy()
    return {"hand, Linen": hand, "fleet, Linen": with_fleet}


def main() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    make = functools.partial(MLP, SIZES)
    x, y = batch_of(SIZES[:1], 16)
    hand = make_shard_map(make, x, y, mesh, TX)
    fleet_default = make_fleet(make, x, y, fleet.DistributedStrategy(), tx=TX)
    fleet_nan = make_fleet(make, x, y, fleet.DistributedStrategy(check_nan_inf=True), tx=TX)
    # Its own step: a step's fast path recalls the kind of batch of its last call
    # (a loop passes one kind), and each switch would take one full call.
    fleet_on_numpy = make_fleet(make, x, y, fleet.DistributedStrategy(), tx=TX)
    fleet_numpy = fleet_on_numpy.numpy
    fleet_numpy.strategy = fleet_on_numpy.strategy  # (see _steps.use)
    variants = {
        "hand": hand, "fleet": fleet_default,
        "hand, numpy batch": hand.numpy, "fleet, numpy batch": fleet_numpy,
        "jax.jit": make_plain_jit(make, x, y, mesh, TX), "fleet, check_nan_inf": fleet_nan,
        # What a JAX user writes to skip non-finite updates on the device:
        "jax.jit, apply_if_finite": make_plain_jit(make, x, y, mesh, CHECKED_TX),
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
    checked = "jax.jit, apply_if_finite"
    print(f"{'variant':26s} {'dispatch':>9s} {'vs jax.jit':>11s} {'vs checked':>11s} "
          f"{'cpu':>7s} {'done':>8s}")
    for name in ("jax.jit", "fleet", checked, "fleet, check_nan_inf"):
        ratio = "" if name == "jax.jit" else f"{wall[name] / wall['jax.jit']:11.2f}"
        versus = f"{wall[name] / wall[checked]:11.2f}" if name == "fleet, check_nan_inf" else ""
        print(f"{name:26s} {wall[name]:9.1f} {ratio:>11s} {versus:>11s} {cpu[name]:7.1f} "
              f"{done[name]:8.1f}")
    print(f"  (vs checked: against {checked}, jax.jit of the same step whose optax "
          "transformation skips non-finite updates on the device, as check_nan_inf keeps "
          "the state)")
    linen, _, _ = measure(linen_variants(x, y, mesh))
    print(f"\na Linen TrainState step (its own {args.rounds} interleaved rounds; host cost "
          "per call, µs)")
    print(f"{'hand, Linen':22s} {linen['hand, Linen']:8.1f}")
    print(f"{'fleet, Linen':22s} {linen['fleet, Linen']:8.1f} "
          f"{linen['fleet, Linen'] / linen['hand, Linen']:8.2f}")


if __name__ == "__main__":
    main()
