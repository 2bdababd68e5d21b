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
``--steps`` steps. One variant's state is on the devices at a time: each
variant keeps its wrapped model, optimizer and compiled step, but its arrays
are freed after its turn and built afresh (the same initial values, one
untimed step) before its next one. (Keeping all four MLP variants' parameters
and Adam moments, 1.2 GB each over 4 devices, alive at once peaked at 8.5 GB
of resident memory; now about 3.5 GB.) Sizes are as they were.

The table shows, per variant: ``ms/step`` and ``images/s`` (MLP: rows), its
median round; ``vs fp32`` (the ResNet: ``vs sync_``), the median over rounds
of the baseline's ms / the variant's ms in the same round (above 1: faster),
which a load that changes between rounds does not tilt, and ``rounds``, that
ratio's lowest-highest; so ``vs fp32`` need not equal the ratio of the ms
medians, and a line says when that ratio falls outside the rounds' range (the
load changed during the run). Then the compiled step's memory per device
(``memory_analysis()``: temporaries, arguments, outputs), and ``grad temp
MB``, the temporaries of a step that only computes the gradient (no new state
whose free output buffers could hold them). The CNN's temporaries are mostly
activations, so amp and recompute move them; the MLP's (256 rows over 4
devices) are the float32 gradients and their all-reduce, the same in every
variant, and a line under its table says so (as the ResNet's says why its two
match).

On CPU, bfloat16 matmuls usually run slower than float32 (no bf16 units), so
amp is expected to lose there; the target on a GPU is amp bf16 >= 1.5x the
fp32 images/s on the MLP.

    .venv/bin/python benchmarks/strategy.py [--steps 2] [--repeats 5] [--models cnn,mlp]
    .venv/bin/python benchmarks/strategy.py --quick                  # smoke run, small MLP
    .venv/bin/python benchmarks/strategy.py --device-count 1         # one GPU
    .venv/bin/python benchmarks/strategy.py --device-count 1 --models mlp --batch-scale 32
    .venv/bin/python benchmarks/strategy.py --models resnet          # the cost of sync_batch_norm
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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
parser.add_argument("--batch-scale", type=int, default=1,
                    help="multiplies each model's global batch (a GPU is launch-bound at the "
                         "defaults: --batch-scale 32 gives the MLP 8192 rows)")
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
# (PJRT_NPROC, fleet/runtime/_xla_flags.py) so that collectives over the fake devices cannot deadlock.
import fleet  # noqa: E402
from fleet.runtime import _world  # noqa: E402

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


def build(make):
    """A variant's model and Adam optimizer, under the strategy in effect (call
    ``use`` first)."""
    model = fleet.distributed_model(make(nnx.Rngs(0)))
    return model, fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))


def use(strategy):
    """Makes ``strategy`` the world's (same devices), for the variant built with it."""
    fleet.init(is_collective=True, strategy=strategy)


def release(*objs):
    """Frees the arrays of ``objs``' state (the objects stay, holding deleted
    arrays until :func:`refill`): one variant's state on the devices at a time
    (the MLP's parameters and Adam moments are 1.2 GB over 4 devices)."""
    for obj in objs:
        for a in jax.tree.leaves(nnx.state(obj)):
            if isinstance(a, jax.Array):
                a.delete()
    gc.collect()
    if TRIM is not None:
        TRIM(0)


try:  # glibc keeps freed buffers below 32 MB in its heaps; malloc_trim returns them
    TRIM = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError):  # not glibc (macOS)
    TRIM = None


def refill(make, model, optimizer):
    """Gives a variant's model and optimizer fresh state, the initial values again
    (built under the strategy in effect): the same objects, so that its step runs
    the program it compiled (a new distributed optimizer would be a new graph)."""
    fresh = build(make)
    nnx.update(model, nnx.state(fresh[0]))
    nnx.update(optimizer, nnx.state(fresh[1]))


def mb(memory, field):
    value = getattr(memory, field, None) if memory is not None else None
    return f"{value / 2**20:8.1f}" if value is not None else f"{'n/a':>8s}"


MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")


def same_memory(analyses):
    """Whether every variant's memory columns read the same (to 0.1 MB)."""
    rows = {tuple(mb(m, f) for f in MEMORY_FIELDS) + (mb(g, "temp_size_in_bytes"),)
            for m, g in analyses.values()}
    return len(rows) == 1


def why_same(name, analyses, grad_bytes):
    """The line that says why the memory columns do not tell the variants apart."""
    memory, grads = next(iter(analyses.values()))
    temp = getattr(memory, "temp_size_in_bytes", None)
    grad_temp = getattr(grads, "temp_size_in_bytes", None)
    if name == "resnet":
        return ("  (memory the same for both: sync_batch_norm adds the all-reduce of each "
                "BatchNorm layer's mean and variance, under 1 KB a layer)")
    if temp is None or grad_temp is None:
        return "  (memory the same for every variant)"
    line = (f"  (memory the same for every variant: temp is {temp / grad_bytes:.2f} x and grad temp "
            f"{grad_temp / grad_bytes:.2f} x the float32 gradients ({grad_bytes / 2**20:.1f} MB a "
            "device):\n   the peak is the gradient all-reduce, float32 in every variant; the "
            "activations that amp halves and recompute drops are dead by then")
    if jax.devices()[0].platform == "cpu":
        line += (";\n   XLA:CPU runs a bfloat16 all-reduce in float32 (it promotes it), so "
                 "fp16_allreduce changes no buffer here")
    return line + ")"


def measure(name: str) -> None:
    make, shape, batch, checkpoints = MODELS[name]
    batch *= args.batch_scale
    rng = np.random.RandomState(0)
    x = rng.randn(batch, *shape).astype(np.float32)
    y = rng.randint(0, 10, batch).astype(np.int32)
    load = os.getloadavg()[0]
    chosen = strategies(checkpoints)
    _world._WORLD = None  # a fresh world for this model, on the chosen devices
    fleet.init(is_collective=True, strategy=next(iter(chosen.values())), devices=devices())
    w = fleet.world()
    xs, ys = jax.device_put(x, w.batch), jax.device_put(y, w.batch)
    # One variant's state at a time: each is built, its step compiled and warmed
    # up, and its arrays freed before the next is built; the objects and the
    # compiled steps stay.
    kept, steps, analyses, traced = {}, {}, {}, {}
    for v, strategy in chosen.items():
        use(strategy)
        kept[v] = model, optimizer = build(make)
        steps[v] = step = fleet.distributed_step(train_step)
        memory = step.lower(model, optimizer, xs, ys).compile().memory_analysis()
        # The gradient alone: no new state whose free output buffers hide the activations.
        grads = fleet.distributed_step(grad_step).lower(model, xs, ys).compile().memory_analysis()
        analyses[v] = (memory, grads)
        nparams = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
        for _ in range(0 if args.quick else 1):
            step(model, optimizer, xs, ys)
        jax.block_until_ready(step(model, optimizer, xs, ys))
        traced[v] = step.trace_count
        release(model, optimizer)
    # Interleaved rounds; in each, every variant gets its initial state again, runs
    # one step untimed, times --steps steps, and frees its state.
    times = {v: [] for v in chosen}
    for _ in range(args.repeats):
        for v, strategy in chosen.items():
            use(strategy)
            model, optimizer = kept[v]
            refill(make, model, optimizer)
            step = steps[v]
            jax.block_until_ready(step(model, optimizer, xs, ys))
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = step(model, optimizer, xs, ys)
            jax.block_until_ready(out)
            times[v].append((time.perf_counter() - t0) / args.steps)
            release(model, optimizer)
    retraced = [v for v, step in steps.items() if step.trace_count != traced[v]]
    base = next(iter(times))
    base_t = np.array(times[base])
    print(f"\n{name}: {nparams / 1e6:.2f}M parameters, Adam, global batch {batch}, "
          f"{len(devices())} x {jax.devices()[0].platform}, "
          f"{args.repeats} rounds x {args.steps} step{'s' * (args.steps != 1)}; memory per device")
    print(f"{'variant':18s} {'ms/step':>8s} {'images/s':>9s} {'vs ' + base[:5]:>8s} "
          f"{'rounds':>13s} {'temp MB':>8s} {'args MB':>8s} {'out MB':>8s} {'grad temp MB':>13s}")
    outside = []
    for v, t in times.items():
        t = np.array(t)
        ratios = base_t / t
        memory, grads = analyses[v]
        print(f"{v:18s} {np.median(t) * 1e3:8.2f} {batch / np.median(t):9.1f} "
              f"{np.median(ratios):8.3f} {ratios.min():6.3f}-{ratios.max():<6.3f} "
              f"{mb(memory, 'temp_size_in_bytes')} "
              f"{mb(memory, 'argument_size_in_bytes')} {mb(memory, 'output_size_in_bytes')} "
              f"{mb(grads, 'temp_size_in_bytes'):>13s}")
        of_medians = np.median(base_t) / np.median(t)
        if not ratios.min() <= of_medians <= ratios.max():
            outside.append(f"{v} {of_medians:.3f}")
    print(f"  (ms/step, images/s: the variant's median round; vs {base[:5]}: the median over "
          f"rounds of {base}'s ms / the variant's ms in the same round\n"
          "   (above 1: faster), which a load that changes between rounds does not tilt; "
          "rounds: that ratio's lowest-highest)")
    if outside:
        print(f"  (the ratio of the ms medians falls outside the rounds' range: "
              f"{', '.join(outside)}; the load changed during the run, so trust no ratio here)")
    if same_memory(analyses):
        print(why_same(name, analyses, 4 * nparams))
    print(f"  (load average over 1 min: {load:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores)")
    if retraced:
        print(f"  (retraced while timed: {', '.join(retraced)})")
    if name == "mlp" and jax.devices()[0].platform == "gpu":
        speed = np.median(base_t / np.array(times["amp bf16"]))
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
