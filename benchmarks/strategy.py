"""Benchmark: what the strategy's sections cost or save, per step and in memory.

Four strategies, each a fresh ``fleet.init`` and a freshly wrapped model and
Adam optimizer:

* ``fp32``: ``fleet.DistributedStrategy()`` (the defaults);
* ``amp bf16``: ``strategy.amp = True`` (``amp_configs.dtype`` "bfloat16");
* ``amp + recompute``: amp, and ``strategy.recompute = True`` (``policy``
  "nothing_saveable") on the MLP's three blocks, or on the CNN's three
  convolutions and first linear layer;
* ``fp16_allreduce``: ``strategy.fp16_allreduce = True`` (the gradient
  buckets travel as bfloat16).

Two models: the seed's CIFAR-10 CNN (examples/cifar10, global batch 128) and
an MLP of 25M parameters (six 2048 x 2048 Linear + ReLU layers in three
blocks of two, and a 10-way head; global batch 256). A third, ``--models
resnet`` (the CIFAR-10 example's ResNet-8, BatchNorm after every convolution,
global batch 128), compares ``sync_batch_norm = True`` (global-batch
statistics, one small all-reduce per BatchNorm layer) with ``False`` (DDP's
per-replica statistics): what the synced statistics cost. On 4 CPU devices by default; ``--device-count
1`` runs on whatever ``jax.devices()`` gives (one GPU).

Variants run interleaved, round after round (``--repeats``), each timing
``--steps`` steps; the table shows the median ms per step, the images (MLP:
rows) per second at that median, the median of the per-round throughput
ratios against the first variant (fp32; the ResNet: sync_batch_norm; above 1:
faster), and the compiled step's memory per
device (``memory_analysis()``: temporaries, arguments, outputs). XLA places
temporaries (gradients, activations) in the output buffers of the new state
while those are still free, so ``temp MB`` can read near zero (the MLP on
CPU); the outputs are shown beside it, and ``grad temp MB`` is the temporary
memory of a step that only computes the gradient (activations, mostly).

On CPU, bfloat16 matmuls usually run slower than float32 (no bf16 units), so
amp is expected to lose there; the target on a GPU is amp bf16 >= 1.5x the
fp32 images/s on the MLP.

    .venv/bin/python benchmarks/strategy.py [--steps 2] [--repeats 5] [--models cnn,mlp]
    .venv/bin/python benchmarks/strategy.py --quick                  # smoke run, small MLP
    .venv/bin/python benchmarks/strategy.py --device-count 1         # one GPU
    .venv/bin/python benchmarks/strategy.py --models resnet          # the cost of sync_batch_norm
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--device-count", "--device_count", type=int, default=4,
                    help="CPU devices to fake (default 4); 1: the first of jax.devices(), "
                         "CPU not forced (a GPU run)")
parser.add_argument("--steps", type=int, default=None, help="steps per timing (default 2)")
parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5)")
parser.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp, resnet")
parser.add_argument("--quick", action="store_true",
                    help="smoke run: 2 rounds x 1 step, one warm-up step, MLP of width 512 (1.6M)")
args = parser.parse_args()
if args.steps is None:
    args.steps = 1 if args.quick else 2
if args.repeats is None:
    args.repeats = 2 if args.quick else 5

if args.device_count > 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.device_count}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "cifar10"))
from train import MyNet as CifarCNN  # noqa: E402  (the seed's CNN, examples/cifar10)
from train import ResNet as CifarResNet  # noqa: E402

# fleet, imported before the first computation, sizes XLA:CPU's thread pool
# (PJRT_NPROC, fleet/_xla_flags.py) so that collectives over the fake devices cannot deadlock.
import fleet  # noqa: E402
from fleet import _world  # noqa: E402

WIDTH = 512 if args.quick else 2048
DEPTH = 6


class Block(nnx.Module):
    """Two layers: recomputing the block drops the activations between them (a
    one-layer block would save nothing: its input is kept either way)."""

    def __init__(self, width, rngs):
        self.linear1 = nnx.Linear(width, width, rngs=rngs)
        self.linear2 = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.linear2(nnx.relu(self.linear1(x))))


class MLP(nnx.Module):
    """DEPTH layers of WIDTH x WIDTH in blocks of two, and a 10-way head: 25.2M
    parameters at 2048."""

    def __init__(self, rngs):
        self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(DEPTH // 2)])
        self.head = nnx.Linear(WIDTH, 10, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


MODELS = {  # name -> (constructor, input shape per example, global batch, recomputed modules)
    "cnn": (CifarCNN, (32, 32, 3), 128, ["conv1", "conv2", "conv3", "linear1"]),
    "mlp": (MLP, (WIDTH,), 64 if args.quick else 256, [f"blocks.{i}" for i in range(DEPTH // 2)]),
    "resnet": (CifarResNet, (32, 32, 3), 128, None),
}


def strategies(checkpoints):
    """The variants, the first the baseline of the ratio column."""
    if checkpoints is None:  # the ResNet: its BatchNorm statistics
        return {"sync_batch_norm": fleet.DistributedStrategy(sync_batch_norm=True),
                "per-replica bn": fleet.DistributedStrategy(sync_batch_norm=False)}
    fp32 = fleet.DistributedStrategy()
    amp = fleet.DistributedStrategy()
    amp.amp = True
    recompute = fleet.DistributedStrategy()
    recompute.amp = True
    recompute.recompute = True
    recompute.recompute_configs = {"checkpoints": checkpoints, "policy": "nothing_saveable"}
    fp16_allreduce = fleet.DistributedStrategy()
    fp16_allreduce.fp16_allreduce = True
    return {"fp32": fp32, "amp bf16": amp, "amp + recompute": recompute,
            "fp16_allreduce": fp16_allreduce}


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
    optimizer.update(model, grads)
    return loss


def grad_step(model, x, y):
    return nnx.grad(lambda m: loss_of(m(x), y))(model)


def devices():
    return jax.devices()[: args.device_count]


def make_fleet(make, x, y, strategy):
    """A variant: (run one step, the compiled step's memory analysis, the step).
    Call ``use(strategy)`` before running it."""
    _world._WORLD = None  # a fresh world for this strategy
    fleet.init(is_collective=True, strategy=strategy, devices=devices())
    model = fleet.distributed_model(make(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    step = fleet.distributed_step(train_step)
    w = fleet.world()
    xs, ys = jax.device_put(x, w.batch), jax.device_put(y, w.batch)
    memory = step.lower(model, optimizer, xs, ys).compile().memory_analysis()
    # The gradient alone: no new state whose free output buffers hide the activations.
    grads = fleet.distributed_step(grad_step).lower(model, xs, ys).compile().memory_analysis()
    return lambda: step(model, optimizer, xs, ys), (memory, grads), step


def use(strategy):
    """Makes ``strategy`` the world's again (same devices), for the variant built with it."""
    fleet.init(is_collective=True, strategy=strategy)


def mb(memory, field):
    value = getattr(memory, field, None) if memory is not None else None
    return f"{value / 2**20:8.1f}" if value is not None else f"{'n/a':>8s}"


def measure(name: str) -> None:
    make, shape, batch, checkpoints = MODELS[name]
    rng = np.random.RandomState(0)
    x = rng.randn(batch, *shape).astype(np.float32)
    y = rng.randint(0, 10, batch).astype(np.int32)
    load = os.getloadavg()[0]
    chosen = strategies(checkpoints)
    variants = {v: make_fleet(make, x, y, s) for v, s in chosen.items()}
    for v, (run, _, _) in variants.items():  # compile and warm up
        use(chosen[v])
        for _ in range(0 if args.quick else 1):
            run()
        jax.block_until_ready(run())
    traced = {v: step.trace_count for v, (_, _, step) in variants.items()}
    times = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v, (run, _, _) in variants.items():
            use(chosen[v])
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = run()
            jax.block_until_ready(out)
            times[v].append((time.perf_counter() - t0) / args.steps)
    retraced = [v for v, (_, _, step) in variants.items() if step.trace_count != traced[v]]
    base = next(iter(times))
    fp32 = np.array(times[base])
    nparams = sum(p.size for p in jax.tree.leaves(nnx.state(make(nnx.Rngs(0)), nnx.Param)))
    print(f"\n{name}: {nparams / 1e6:.2f}M parameters, Adam, global batch {batch}, "
          f"{len(devices())} x {jax.devices()[0].platform}, "
          f"{args.repeats} rounds x {args.steps} step{'s' * (args.steps != 1)}; memory per device")
    print(f"{'variant':18s} {'ms/step':>8s} {'images/s':>9s} {'vs ' + base[:5]:>8s} "
          f"{'temp MB':>8s} {'args MB':>8s} {'out MB':>8s} {'grad temp MB':>13s}")
    for v, t in times.items():
        t = np.array(t)
        memory, grads = variants[v][1]
        print(f"{v:18s} {np.median(t) * 1e3:8.2f} {batch / np.median(t):9.1f} "
              f"{np.median(fp32 / t):8.3f} {mb(memory, 'temp_size_in_bytes')} "
              f"{mb(memory, 'argument_size_in_bytes')} {mb(memory, 'output_size_in_bytes')} "
              f"{mb(grads, 'temp_size_in_bytes'):>13s}")
    print(f"  (load average over 1 min: {load:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores)")
    if retraced:
        print(f"  (retraced while timed: {', '.join(retraced)})")
    if name == "mlp" and jax.devices()[0].platform == "gpu":
        speed = np.median(fp32 / np.array(times["amp bf16"]))
        print(f"  GPU target, amp bf16 >= 1.5x fp32 images/s: {speed:.2f}x, "
              f"{'met' if speed >= 1.5 else 'NOT met'}")


def main():
    d = jax.devices()[0]
    print(f"device: {len(devices())} x {d.device_kind} ({d.platform}), jax {jax.__version__}, "
          f"flax {flax.__version__}, optax {optax.__version__}")
    print(f"command: python {shlex.join(sys.argv)}")
    for name in args.models.split(","):
        measure(name)


if __name__ == "__main__":
    main()
