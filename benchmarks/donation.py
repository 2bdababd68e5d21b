"""Benchmark: a step's memory at the step boundary, fleet against hand-written
donating steps, side by side (issue 24, item 1). The time to dispatch steps
without waiting is benchmarks/host_cost.py's (a tiny model: here the device's
time would be measured, as JAX's CPU client waits once 32 programs are in flight).

Two models with Adam on 4 CPU devices: an MLP of 8.4M parameters and the
seed's CIFAR-10 CNN (examples/cifar10).

Memory, per device, from ``compile().memory_analysis()``:
the bytes live at the step boundary, arguments + outputs + temporaries -
aliased (the donated inputs whose buffers the outputs reuse). Baselines:

* ``hand``: ``jax.jit(jax.shard_map(step))`` by hand, parameters and optimizer
  state donated (``donate_argnums``);
* ``hand, sharded``: the same with the optimizer state split over the devices
  (ZeRO, by hand: gradients reduce-scattered, Adam on each device's slice, the
  new parameters all-gathered), parameters and slices donated.

fleet: its default (donating), ``donate=False``, ``check_nan_inf``, and
``strategy.sharding`` stage 1 and 2 (against ``hand, sharded``).

    .venv/bin/python benchmarks/donation.py [--models mlp,cnn]
"""

from __future__ import annotations

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--models", default="mlp,cnn")
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _steps import MLP, CifarCNN, batch_of, loss_of, make_fleet  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fleet  # noqa: E402

SIZES = (1024, 2048, 2048, 1024, 10)  # 8.4M parameters
MODELS = {"mlp": (functools.partial(MLP, SIZES), (SIZES[0],), 64),
          "cnn": (CifarCNN, (32, 32, 3), 128)}
N = 4


def live(memory) -> int:
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def hand(make, x, y, mesh, sharded: bool):
    """The hand-written step's lowered program (``sharded``: ZeRO by hand)."""
    graphdef, params = nnx.split(make(nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-3)
    repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    leaves, treedef = jax.tree.flatten(params)
    pad = [(-x.size) % N for x in leaves]

    def flat(p):  # each leaf flattened and padded to a multiple of N
        return [jnp.pad(v.reshape(-1), (0, k)) for v, k in zip(jax.tree.leaves(p), pad)]

    def grads_of(params, x, y):
        return jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p)(x), y))(params)

    if not sharded:
        def body(params, opt_state, x, y):
            loss, grads = grads_of(params, x, y)
            grads = jax.tree.map(lambda g: g / N, grads)  # the transpose summed them
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")
        opt_state = tx.init(params)
        specs = (P(), P())
        state = (jax.device_put(params, repl), jax.device_put(opt_state, repl))
    else:
        def body(params, opt_state, x, y):
            loss, grads = grads_of(jax.tree.map(lambda v: jax.lax.pcast(v, "data", to="varying"),
                                                params), x, y)
            i = jax.lax.axis_index("data")
            g = [jax.lax.psum_scatter(v, "data", scatter_dimension=0, tiled=True) / N
                 for v in flat(grads)]
            p = [jax.lax.dynamic_slice_in_dim(v, i * (v.size // N), v.size // N)
                 for v in flat(params)]
            updates, opt_state = tx.update(g, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, jax.lax.pmean(loss, "data")
        opt_state = tx.init(flat(params))
        specs = (P(), jax.tree.map(lambda v: P("data") if v.ndim else P(), opt_state))
        state = (jax.device_put(params, repl),
                 jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)),
                              opt_state, specs[1]))
    out_specs = (P("data") if sharded else P(), specs[1], P())
    run = jax.shard_map(body, mesh=mesh, in_specs=(*specs, P("data"), P("data")),
                        out_specs=out_specs)

    def outer(params, opt_state, x, y):  # (sharded: the new slices all-gathered by XLA)
        new, opt_state, loss = run(params, opt_state, x, y)
        if sharded:
            new = jax.tree.unflatten(treedef, [v[:v.size - k].reshape(o.shape)
                                               for v, k, o in zip(new, pad, leaves)])
        return new, opt_state, loss

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), (P(), specs[1], P()))
    step = jax.jit(outer, donate_argnums=(0, 1), out_shardings=shardings)
    return step.lower(*state, jax.device_put(x, data), jax.device_put(y, data))


def fleet_lowered(make, x, y, strategy, donate=True):
    step, model, optimizer, xs, ys = make_fleet(make, x, y, strategy, donate).parts
    if strategy.sharding:  # the optimizer state is split at the first call
        jax.block_until_ready(step(model, optimizer, xs, ys))
    return step.lower(model, optimizer, xs, ys)


def memory(name: str) -> None:
    make, shape, batch = MODELS[name]
    x, y = batch_of(shape, batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

    def stage(k):
        return fleet.DistributedStrategy(sharding=True, sharding_configs={"stage": k})

    rows = {
        "hand (donating)": (hand(make, x, y, mesh, False), None),
        "hand, sharded (donating)": (hand(make, x, y, mesh, True), None),
        "fleet, default": (fleet_lowered(make, x, y, fleet.DistributedStrategy()), "hand"),
        "fleet, donate=False": (fleet_lowered(make, x, y, fleet.DistributedStrategy(),
                                              donate=False), "hand"),
        "fleet, check_nan_inf": (fleet_lowered(make, x, y, fleet.DistributedStrategy(
            check_nan_inf=True)), "hand"),
        "fleet, sharding stage 1": (fleet_lowered(make, x, y, stage(1)), "sharded"),
        "fleet, sharding stage 2": (fleet_lowered(make, x, y, stage(2)), "sharded"),
    }
    analysis = {k: lowered.compile().memory_analysis() for k, (lowered, _) in rows.items()}
    base = {"hand": live(analysis["hand (donating)"]),
            "sharded": live(analysis["hand, sharded (donating)"])}
    nparams = sum(p.size for p in jax.tree.leaves(nnx.state(make(nnx.Rngs(0)), nnx.Param)))
    print(f"\nmemory, {name}: {nparams / 1e6:.2f}M parameters, Adam, global batch {batch}, "
          f"{N} x cpu, per device (jax {jax.__version__})")
    print(f"{'variant':28s} {'args MB':>8s} {'out MB':>7s} {'temp MB':>8s} {'alias MB':>9s} "
          f"{'live MB':>8s} {'vs hand':>8s}")
    for k, (_, against) in rows.items():
        m = analysis[k]
        ratio = f"{live(m) / base[against]:8.3f}" if against else f"{'':8s}"
        print(f"{k:28s} {m.argument_size_in_bytes / 2**20:8.2f} {m.output_size_in_bytes / 2**20:7.2f} "
              f"{m.temp_size_in_bytes / 2**20:8.2f} {m.alias_size_in_bytes / 2**20:9.2f} "
              f"{live(m) / 2**20:8.2f} {ratio}")
    print("  (live MB = args + out + temp - alias; vs hand: against hand (donating), the "
          "sharding rows against hand, sharded (donating))")


def main():
    for name in args.models.split(","):
        memory(name)


if __name__ == "__main__":
    main()
