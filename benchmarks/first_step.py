"""Benchmark: time to the first finished step of a deep model, fleet against the
hand-written steps.

A first call traces the step, checks it (fleet), compiles it and runs it; on a
deep model the tracing is a visible part of that time. Each measurement runs in
a fresh Python process (so no in-memory cache helps, and the persistent
compilation cache is off), on 4 fake CPU devices: the model is built and the
world set up untimed, then the wall time from the first call to
``jax.block_until_ready`` of its outputs is measured. The user's step function
is wrapped in a counter: the table shows how often each variant traced it
during that first call.

The model: a pre-norm Transformer of ``--layers`` blocks (attention and an MLP,
width 32, 4 heads, 8 tokens), Adam, a global batch of 16 sequences. Variants:

* (a) ``jax.jit(jax.shard_map(...))`` by hand: replicated parameters, gradients
  summed by shard_map's transpose and divided by N;
* (b) ``nnx.jit`` of the single-device step, the batch sharded over ``data``
  (XLA's partitioner inserts the all-reduce);
* (c) ``jax.jit(jax.shard_map(...))`` by hand around the very step fleet is
  given (``nnx.value_and_grad``, ``nnx.Optimizer``): the model and optimizer
  split and merged by hand, gradients divided by N. Against (a) fleet also pays
  for NNX's optimizer and graph, which the user's script chose; against (c)
  only for fleet;
* fleet: ``fleet.distributed_step`` with its defaults;
* (d) the same model in Linen with Flax's ``TrainState`` (``TrainState.create``,
  ``jax.value_and_grad``, ``state.apply_gradients``) in a hand-written
  ``jax.jit(jax.shard_map(...))``, the state placed on the mesh first, gradients
  divided by N;
* fleet, Linen: that Linen step as Flax's guides write it, with
  ``fleet.distributed_step`` and the module wrapped (``fleet.distributed_model``):
  a new ``TrainState``'s ``step=0`` is a Python int;
* fleet, Linen, raw parameters: the same without ``fleet.distributed_model``:
  JAX sums the raw parameters' gradients, and fleet's optax optimizer divides them.

The second call is timed too (from its call to its outputs): it must find the
first call's program, not compile another.

Rounds are interleaved (each round starts every variant once, back to back);
the table shows the median seconds and the median of the per-round ratios.

    .venv/bin/python benchmarks/first_step.py [--rounds 5] [--layers 16,48]
        [--compare-with ../fleet-base]   # fleet from another checkout, same rounds
        # (its variants from this file: copy it there if that checkout's is older)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fleet  # noqa: E402

VARIANTS = ("(a) jit+shard_map, by hand", "(b) nnx.jit, sharded batch",
            "(c) same NNX step, by hand", "fleet", "(d) Linen TrainState, by hand",
            "fleet, Linen", "fleet, Linen, raw parameters")
WIDTH, HEADS, TOKENS, BATCH = 32, 4, 8, 16


def child(variant: str, layers: int) -> dict:
    """One first call, in this (fresh) process: its seconds and traces."""
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
            self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.head = nnx.Linear(WIDTH, 10, rngs=rngs)

        def __call__(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(1))

    def loss_of(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, TOKENS, WIDTH).astype(np.float32)
    y = rng.randint(0, 10, BATCH).astype(np.int32)
    traces = [0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.adam(1e-3)

    if variant == VARIANTS[0]:
        graphdef, params = nnx.split(Transformer(nnx.Rngs(0)), nnx.Param)
        n = mesh.devices.size

        def per_device(params, opt_state, x, y):
            traces[0] += 1
            loss, grads = jax.value_and_grad(
                lambda p: loss_of(nnx.merge(graphdef, p)(x), y))(params)
            grads = jax.tree.map(lambda g: g / n, grads)  # the transpose summed them
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

        step = jax.jit(
            jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                          out_specs=(P(), P(), P())),
            donate_argnums=(0, 1), in_shardings=(replicated, replicated, rows, rows))
        args = (jax.device_put(params, replicated), jax.device_put(tx.init(params), replicated),
                jax.device_put(x, rows), jax.device_put(y, rows))
    elif variant == VARIANTS[1]:
        model = Transformer(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, replicated))

        @nnx.jit(donate_argnums=(0, 1))
        def step(model, optimizer, x, y):
            traces[0] += 1
            loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
            optimizer.update(model, grads)
            return loss

        args = (model, optimizer, jax.device_put(x, rows), jax.device_put(y, rows))
    elif variant == VARIANTS[2]:
        model = Transformer(nnx.Rngs(0))
        graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
        n = mesh.devices.size

        def per_device(state, x, y):
            traces[0] += 1
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
            optimizer.update(model, jax.tree.map(lambda g: g / n, grads))  # summed by transpose
            return nnx.state((model, optimizer)), jax.lax.pmean(loss, "data")

        step = jax.jit(
            jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                          out_specs=(P(), P())),
            donate_argnums=0, in_shardings=(replicated, rows, rows))
        args = (jax.device_put(state, replicated), jax.device_put(x, rows),
                jax.device_put(y, rows))
    elif variant in VARIANTS[4:]:
        step, args = linen_step(variant, layers, x, y, traces)
    else:
        fleet.init(is_collective=True)
        model = fleet.distributed_model(Transformer(nnx.Rngs(0)))
        optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))

        def train(model, optimizer, x, y):
            traces[0] += 1
            loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
            optimizer.update(model, grads)
            return loss

        step = fleet.distributed_step(train)
        w = fleet.world()
        args = (model, optimizer, jax.device_put(x, w.batch), jax.device_put(y, w.batch))
    jax.block_until_ready([a for a in jax.tree.leaves(args) if isinstance(a, jax.Array)])
    t0 = time.perf_counter()
    out = jax.block_until_ready(step(*args))
    first, traced = time.perf_counter() - t0, traces[0]
    if variant == VARIANTS[0]:  # (the donated state: the next call takes what came back)
        args = (*out[:2], *args[2:])
    elif variant in (VARIANTS[2], *VARIANTS[4:]):
        args = (out[0], *args[1:])
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    return {"seconds": first, "second": time.perf_counter() - t0, "traces": traced}


def linen_step(variant: str, layers: int, x: np.ndarray, y: np.ndarray, traces: list):
    """The Linen variants' step and first arguments: the same Transformer in Linen,
    a ``TrainState`` as Flax's guides make it."""
    from flax import linen
    from flax.training.train_state import TrainState

    class Block(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = x + linen.MultiHeadDotProductAttention(HEADS)(linen.LayerNorm()(x))
            h = linen.gelu(linen.Dense(4 * WIDTH)(linen.LayerNorm()(x)))
            return x + linen.Dense(WIDTH)(h)

    class Transformer(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = linen.Dense(WIDTH)(x)
            for _ in range(layers):
                x = Block()(x)
            return linen.Dense(10)(x.mean(1))

    def train(state, x, y, n=1):
        traces[0] += 1

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        if n > 1:  # (by hand: the transpose summed them)
            grads = jax.tree.map(lambda g: g / n, grads)
        return state.apply_gradients(grads=grads), loss

    module = Transformer()
    if variant != VARIANTS[4]:
        fleet.init(is_collective=True)
        if variant == VARIANTS[5]:
            module = fleet.distributed_model(module)
    params = module.init(jax.random.key(0), x[:1])["params"]
    if variant != VARIANTS[4]:
        state = TrainState.create(apply_fn=module.apply, params=params,
                                  tx=fleet.distributed_optimizer(optax.adam(1e-3)))
        return fleet.distributed_step(train), (state, x, y)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    n = mesh.devices.size
    state = jax.device_put(TrainState.create(apply_fn=module.apply, params=params,
                                             tx=optax.adam(1e-3)), replicated)

    def per_device(state, x, y):
        state, loss = train(state, x, y, n)
        return state, jax.lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P())),
                   donate_argnums=0, in_shardings=(replicated, rows, rows))
    return step, (state, jax.device_put(x, rows), jax.device_put(y, rows))


def run_child(variant: str, layers: int, devices: int, script: str = __file__) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a fresh compile every time
    done = subprocess.run(
        [sys.executable, os.path.abspath(script), "--child", variant, "--layers", str(layers)],
        env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{variant} ({layers} layers) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(layers: int, rounds: int, devices: int, other: str | None) -> None:
    runs = {v: (v, __file__) for v in VARIANTS}
    if other:  # fleet from another checkout, in the same rounds
        for v in ("fleet", *VARIANTS[5:]):
            runs[f"{v} at {os.path.basename(os.path.abspath(other))}"] = (
                v, os.path.join(other, "benchmarks", "first_step.py"))
    got = {v: [] for v in runs}
    second = {v: [] for v in runs}
    traces = {}
    for _ in range(rounds):
        for v, (variant, script) in runs.items():
            r = run_child(variant, layers, devices, script)
            got[v].append(r["seconds"])
            second[v].append(r.get("second", float("nan")))
            traces[v] = r["traces"]
    a, c = np.array(got[VARIANTS[0]]), np.array(got[VARIANTS[2]])
    print(f"\n{layers}-layer Transformer (width {WIDTH}, {HEADS} heads, {TOKENS} tokens), Adam, "
          f"global batch {BATCH}, {devices} CPU devices, {rounds} rounds, a fresh process each")
    d = np.array(got[VARIANTS[4]])
    print(f"{'variant':34s} {'first step s':>12s} {'min s':>6s} {'vs (a)':>7s} {'vs (c)':>7s} "
          f"{'vs (d)':>7s} {'min vs (a)':>10s} {'min vs (c)':>10s} {'traces':>6s} "
          f"{'second s':>8s}")
    for v in runs:
        t = np.array(got[v])
        print(f"{v:34s} {np.median(t):12.2f} {t.min():6.2f} {np.median(t / a):7.3f} "
              f"{np.median(t / c):7.3f} {np.median(t / d):7.3f} {t.min() / a.min():10.3f} "
              f"{t.min() / c.min():10.3f} {traces[v]:6d} {np.median(second[v]):8.3f}")
    for v in runs:
        print(f"  {v}: " + " ".join(f"{x:.2f}" for x in got[v]))
    print("  (first step s: the median over rounds of the wall time from the first call to "
          "its outputs being ready; min s: the fastest round's; vs (a), vs (c): the median "
          "over rounds of the per-round ratios; min vs: the ratio of the fastest rounds, the "
          "least disturbed by other load; traces: how often the step function was called "
          "while the first call traced it; second s: the median time of the second call, "
          "which compiles nothing when it finds the first call's program; then each "
          "round's seconds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", default="16", help="comma-separated depths, e.g. 16,48")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices to fake")
    parser.add_argument("--compare-with", metavar="CHECKOUT",
                        help="also time fleet from another checkout of the repository (one "
                             "holding this benchmark), e.g. the base commit's")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, int(args.layers))))
        return
    for layers in args.layers.split(","):
        measure(int(layers), args.rounds, args.devices, args.compare_with)


if __name__ == "__main__":
    main()
