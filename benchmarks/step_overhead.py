"""Benchmark: fleet's step against a hand-written ``jax.pmap`` step, side by side.

An MLP of about 2M parameters, Adam, global batch 256 on 4 CPU devices (or the
local GPUs with ``--platform gpu``). Variants run interleaved, round after
round, each timing ``--steps`` steps; the table shows median ms per step and the
median of the per-round ratios against ``pmap``.

    python benchmarks/step_overhead.py [--rounds 15] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--devices", type=int, default=4, help="CPU devices to fake (CPU only)")
parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=256, help="global batch")
args = parser.parse_args()

if args.platform == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fleet  # noqa: E402

SIZES = (784, 1024, 1024, 256, 10)  # 2.1M parameters


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(SIZES[:-1], SIZES[1:])]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_pmap(x, y):
    """The hand-written baseline: pure params, pmean of the gradient tree, optax."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-3)
    n = jax.local_device_count()

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return loss_of(nnx.merge(graphdef, p)(x), y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    pstep = jax.pmap(step, axis_name="data", donate_argnums=(0, 1))
    # Inputs in pmap's own layout (made by a pmap), so no call pays a reshard.
    put = jax.pmap(lambda tree: tree)

    def stack(tree):  # one copy per device, on a leading axis
        return put(jax.tree.map(lambda a: np.stack([np.asarray(a)] * n), tree))

    state = [stack(params), stack(tx.init(params))]
    xs = put(x.reshape(n, -1, *x.shape[1:]))
    ys = put(y.reshape(n, -1))

    def run():
        state[0], state[1], loss = pstep(state[0], state[1], xs, ys)
        return loss

    return run


def make_shard_map(x, y):
    """A second hand-written baseline: jit + shard_map (pmap's engine today). The
    parameters are replicated (invariant), so the gradient comes back already summed
    over devices by shard_map's transpose; one division makes it the mean."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-3)
    n = jax.device_count()

    def per_device(params, opt_state, x, y):
        def loss_fn(p):
            return loss_of(nnx.merge(graphdef, p)(x), y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                      out_specs=(P(), P(), P())),
        donate_argnums=(0, 1),
    )
    replicated = NamedSharding(mesh, P())
    state = [jax.device_put(params, replicated), jax.device_put(tx.init(params), replicated)]
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))

    def run():
        state[0], state[1], loss = step(state[0], state[1], xs, ys)
        return loss

    return run


def make_fleet(x, y, strategy):
    fleet.init(is_collective=True, strategy=strategy)
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))

    @fleet.distributed_step
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    w = fleet.world()
    xs, ys = jax.device_put(x, w.batch), jax.device_put(y, w.batch)
    return lambda: step(model, optimizer, xs, ys)


def strategy(**fields):
    return fleet.DistributedStrategy(**fields)


def main():
    rng = np.random.RandomState(0)
    x = rng.randn(args.batch, SIZES[0]).astype(np.float32)
    y = rng.randint(0, SIZES[-1], args.batch).astype(np.int32)
    variants = {"pmap (hand-written)": make_pmap(x, y),
                "jit+shard_map (hand-written)": make_shard_map(x, y)}
    for name, s in [
        ("fleet, default (32 MB buckets)", strategy()),
        ("fleet, 1 MB buckets", strategy(fuse_grad_size_in_MB=1)),
        ("fleet, 25 MB buckets", strategy(fuse_grad_size_in_MB=25)),
        ("fleet, 100 MB buckets", strategy(fuse_grad_size_in_MB=100, last_comm_group_size_MB=100)),
        ("fleet, fusion off", strategy(fuse_all_reduce_ops=False)),
    ]:
        variants[name] = make_fleet(x, y, s)
    for run in variants.values():  # compile and warm up
        for _ in range(3):
            run()
        jax.block_until_ready(run())

    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)

    base = np.array(times["pmap (hand-written)"])
    base2 = np.array(times["jit+shard_map (hand-written)"])
    devices = f"{jax.device_count()} x {jax.devices()[0].platform}"
    print(f"\nstep overhead: MLP {SIZES}, Adam, global batch {args.batch}, {devices}, "
          f"{args.rounds} rounds x {args.steps} steps (jax {jax.__version__})")
    print(f"{'variant':34s} {'ms/step':>9s} {'ratio vs pmap':>14s} {'vs shard_map':>13s}")
    for name, t in times.items():
        ratio, ratio2 = np.median(np.array(t) / base), np.median(np.array(t) / base2)
        print(f"{name:34s} {np.median(t) * 1e3:9.2f} {ratio:14.3f} {ratio2:13.3f}")


if __name__ == "__main__":
    main()
