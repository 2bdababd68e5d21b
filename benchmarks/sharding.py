"""Benchmark: what ``strategy.sharding`` (ZeRO stage 1 and 2) saves in optimizer
memory and costs in step time, side by side with plain data parallelism.

An MLP of 50.4M parameters (three 4096 x 4096 Linear + ReLU layers and a
10-way head) with Adam, on 4 CPU devices by default, global batch 32. Three
variants, each built under its own ``fleet.init`` over the same devices, with a
freshly wrapped model and optimizer and its own ``fleet.distributed_step``:

* ``stage 0``: ``fleet.DistributedStrategy()`` (no sharding);
* ``stage 1``: ``strategy.sharding = True``, ``sharding_configs = {"stage": 1}``;
* ``stage 2``: ``strategy.sharding = True``, ``sharding_configs = {"stage": 2}``.

Before each call of a variant, outside the timed region, the world's strategy
is switched back to that variant's (``fleet.init`` without ``devices`` keeps
the mesh), since a step reads the world's strategy on every call. Variants run
interleaved, round after round (``--rounds``), each timing ``--steps`` steps, so
that the machine's load falls on all three alike.

The table, per device:

* ``opt MB``: the optimizer state one device holds (Adam's two moments and its
  count), after the first step has split it; ``vs 0`` its ratio to stage 0
  (target: 1 / device count, 0.25 on 4 devices);
* ``temp MB``, ``args MB``, ``out MB``: the compiled step's
  ``memory_analysis()`` (temporaries, arguments, outputs);
* ``ms/step``: the median time per step; ``vs 0``: the median of the per-round
  time ratios against stage 0 (target: at most 1.15);
* ``dparam 1``, ``dparam end``: the largest parameter difference from stage 0
  after the first step and at the end; ``> 1e-6``: how many parameters differ
  by more than 1e-6 at the end.

The targets are reported as met or not; nothing is asserted. The optimizer
state ratio is 1 / device count up to the zero padding of each leaf to a
multiple of the device count and Adam's replicated step count (a few bytes).

Stage 0's ``temp MB`` holds the new optimizer state's moments (as large as
``opt MB``: XLA does not place them in the donated state here); stage 1 keeps each
replica's full local gradients until the optimizer reduce-scatters them, stage 2
only the reduced slices, so stage 1's temporaries are larger.

On CPU the fake devices share the host's cores: stage 0 computes the same Adam
update over all parameters once per device, the sharded stages a quarter of it
each, so the sharded steps can be faster here than on devices that run in
parallel (where the extra all-gather is the cost to watch).

All variants run the same steps on the same batch from the same initial
parameters, so they do the same work; their parameters differ only by the
summation order of the gradient reduction (all-reduce against reduce-scatter).
After one step that is float32 rounding (~1e-9). Later, a handful of parameters
can differ by up to a few times 1e-5 (lr 1e-3 times a few percent): those whose
first gradient was exactly zero (a ReLU unit inactive on the whole batch) have
Adam second moments near zero, so a later gradient of rounding-noise size gets
an update of ``lr * g / (sqrt(v) + eps)`` that magnifies the rounding. Stage 1
and stage 2 reduce identically and agree exactly. To show that this is the noise
floor, the script then runs the single-device step on the global batch and the
split-sum reference (the gradient averaged over the replicas' sub-batches) for
the same steps, and prints each variant's distance from both: a variant is
within the floor when its distance from the split-sum reference is below
``|split-sum - single device|``.

    .venv/bin/python benchmarks/sharding.py [--rounds 5] [--steps 2] [--batch 32]
    .venv/bin/python benchmarks/sharding.py --quick                  # smoke run, MLP of width 512
    .venv/bin/python benchmarks/sharding.py --device-count 1         # one GPU (no sharding to do)
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
parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
parser.add_argument("--steps", type=int, default=None, help="steps per timing (default 2)")
parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
parser.add_argument("--quick", action="store_true",
                    help="smoke run: 2 rounds x 1 step, MLP of width 512 (0.8M)")
args = parser.parse_args()
if args.rounds is None:
    args.rounds = 2 if args.quick else 5
if args.steps is None:
    args.steps = 1 if args.quick else 2

if args.device_count > 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.device_count}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# fleet, imported before the first computation, sizes XLA:CPU's thread pool
# (PJRT_NPROC, fleet/runtime/_xla_flags.py) so that collectives over the fake devices cannot deadlock.
import fleet  # noqa: E402
from fleet.runtime import _world  # noqa: E402

WIDTH = 512 if args.quick else 4096
DEPTH = 3
MEMORY_TARGET = 1 / args.device_count  # optimizer state per device, against stage 0
TIME_TARGET = 1.15  # step time, against stage 0


class MLP(nnx.Module):
    """DEPTH layers of WIDTH x WIDTH and a 10-way head: 50.4M parameters at 4096."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)])
        self.head = nnx.Linear(WIDTH, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


def strategies():
    out = {"stage 0": fleet.DistributedStrategy()}
    for stage in (1, 2):
        s = fleet.DistributedStrategy()
        s.sharding = True
        s.sharding_configs = {"stage": stage}
        out[f"stage {stage}"] = s
    return out


def train_step(model, optimizer, x, y):
    def loss_of(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_of)(model)
    optimizer.update(model, grads)
    return loss


def devices():
    return jax.devices()[: args.device_count]


def use(strategy):
    """Makes ``strategy`` the world's again (same devices), for the variant built with it."""
    fleet.init(is_collective=True, strategy=strategy)


class Variant:
    """One strategy's model, optimizer, step and batch, built under its own world."""

    def __init__(self, strategy, x, y):
        self.strategy = strategy
        _world._WORLD = None  # a fresh world for this strategy
        fleet.init(is_collective=True, strategy=strategy, devices=devices())
        self.model = fleet.distributed_model(MLP(nnx.Rngs(0)))
        self.optimizer = fleet.distributed_optimizer(
            nnx.Optimizer(self.model, optax.adam(1e-3), wrt=nnx.Param))
        self.step = fleet.distributed_step(train_step)
        w = fleet.world()
        self.x, self.y = jax.device_put(x, w.batch), jax.device_put(y, w.batch)
        self.memory = None

    def run(self):
        return self.step(self.model, self.optimizer, self.x, self.y)

    def analyse(self):
        """The compiled step's memory (after the first step split the state)."""
        use(self.strategy)
        lowered = self.step.lower(self.model, self.optimizer, self.x, self.y)
        self.memory = lowered.compile().memory_analysis()

    def opt_bytes(self, device):
        """Optimizer-state bytes that ``device`` holds."""
        return sum(s.data.nbytes for x in jax.tree.leaves(self.optimizer.opt_state)
                   for s in x.addressable_shards if s.device == device)

    def params(self):
        return jax.tree.leaves(nnx.state(self.model, nnx.Param))


def differences(params, base):
    """The largest absolute difference between two parameter lists, and how many
    elements differ by more than 1e-6."""
    diffs = [np.abs(np.asarray(a) - np.asarray(b)) for a, b in zip(params, base)]
    return max(float(d.max()) for d in diffs), int(sum((d > 1e-6).sum() for d in diffs))


def single_device(x, y, steps, split):
    """The single-device script's parameters after ``steps`` steps on the global
    batch; ``split``: the split-sum reference (the gradient averaged over the
    replicas' sub-batches), which shows the float-reordering noise floor."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_of(m, a, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(a), b).mean()

    @nnx.jit
    def step(model, optimizer, x, y):
        if split:
            parts = [nnx.grad(loss_of)(model, a, b)
                     for a, b in zip(jnp.split(x, split), jnp.split(y, split))]
            grads = jax.tree.map(lambda *g: sum(g) / split, *parts)
        else:
            grads = nnx.grad(loss_of)(model, x, y)
        optimizer.update(model, grads)

    device = jax.devices()[0]
    x, y = jax.device_put(x, device), jax.device_put(y, device)
    for _ in range(steps):
        step(model, optimizer, x, y)
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]


def mb(value):
    return f"{value / 2**20:8.1f}" if value is not None else f"{'n/a':>8s}"


def memory_mb(memory, field):
    return mb(getattr(memory, field, None) if memory is not None else None)


def main():
    d = jax.devices()[0]
    print(f"device: {len(devices())} x {d.device_kind} ({d.platform}), jax {jax.__version__}, "
          f"flax {flax.__version__}, optax {optax.__version__}")
    print(f"command: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}")
    rng = np.random.RandomState(0)
    x = rng.randn(args.batch, WIDTH).astype(np.float32)
    y = rng.randint(0, 10, args.batch).astype(np.int32)
    load = os.getloadavg()[0]
    t_build = time.perf_counter()
    variants = {v: Variant(s, x, y) for v, s in strategies().items()}
    first = {}  # after the first step: the largest parameter difference from stage 0
    for name, v in variants.items():  # compile, split the state, warm up
        use(v.strategy)
        jax.block_until_ready(v.run())
        params = [np.asarray(p) for p in v.params()]
        if name == "stage 0":
            base_params = params
        first[name] = differences(params, base_params)[0]
        del params
        jax.block_until_ready(v.run())
    del base_params
    for v in variants.values():
        v.analyse()
    traced = {name: v.step.trace_count for name, v in variants.items()}
    t_timed = time.perf_counter()
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, v in variants.items():
            use(v.strategy)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = v.run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)
    t_end = time.perf_counter()
    retraced = [name for name, v in variants.items() if v.step.trace_count != traced[name]]

    base = variants["stage 0"]
    nparams = sum(p.size for p in base.params())
    dev = devices()[0]
    base_opt = base.opt_bytes(dev)
    base_t = np.array(times["stage 0"])
    steps_run = 2 + args.rounds * args.steps
    print(f"\nMLP: {nparams:,} parameters ({nparams / 1e6:.2f}M, float32), Adam, "
          f"global batch {args.batch}, {len(devices())} x {d.platform}, "
          f"{args.rounds} rounds x {args.steps} step{'s' * (args.steps != 1)}; "
          f"memory per device ({dev})")
    print(f"{'variant':10s} {'opt MB':>8s} {'vs 0':>6s} {'temp MB':>8s} {'args MB':>8s} "
          f"{'out MB':>8s} {'ms/step':>8s} {'vs 0':>6s} {'rounds':>13s} {'dparam 1':>10s} "
          f"{'dparam end':>10s} {'> 1e-6':>7s}")
    outside = []
    verdicts = []
    for name, v in variants.items():
        opt = v.opt_bytes(dev)
        t = np.array(times[name])
        ratio_t = float(np.median(t / base_t))
        diff, count = differences(v.params(), base.params())
        print(f"{name:10s} {mb(opt)} {opt / base_opt:6.3f} "
              f"{memory_mb(v.memory, 'temp_size_in_bytes')} "
              f"{memory_mb(v.memory, 'argument_size_in_bytes')} "
              f"{memory_mb(v.memory, 'output_size_in_bytes')} "
              f"{np.median(t) * 1e3:8.1f} {ratio_t:6.3f} "
              f"{(t / base_t).min():6.3f}-{(t / base_t).max():<6.3f} "
              f"{first[name]:10.2e} {diff:10.2e} {count:>7d}")
        of_medians = np.median(t) / np.median(base_t)
        if not (t / base_t).min() <= of_medians <= (t / base_t).max():
            outside.append(f"{name} {of_medians:.3f}")
        if v is not base:
            verdicts.append((name, opt / base_opt, ratio_t))
    print("  (ms/step: the median over rounds; the second vs 0: the median over rounds of "
          "the variant's ms / stage 0's in the same round, so it need not equal the ratio "
          "of the ms medians; rounds: its lowest-highest)")
    if outside:
        print(f"  (the ratio of the ms medians falls outside the rounds' range: "
              f"{', '.join(outside)}; the load changed during the run, so trust no ratio here)")
    print(f"  (dparam 1, dparam end: the largest parameter difference from stage 0 after the "
          f"first step and after all {steps_run}; > 1e-6: how many of the {nparams:,} "
          f"parameters differ by more than 1e-6 at the end)")
    for name, ratio_m, ratio_t in verdicts:
        print(f"  {name}: optimizer state {ratio_m:.3f}x stage 0 (target <= "
              f"{MEMORY_TARGET:.3f}: {'met' if ratio_m <= MEMORY_TARGET + 1e-3 else 'NOT met'}); "
              f"step time {ratio_t:.3f}x (target <= {TIME_TARGET:.2f}: "
              f"{'met' if ratio_t <= TIME_TARGET else 'NOT met'})")
    print(f"  (build, compile and warm-up {t_timed - t_build:.0f} s, timed rounds "
          f"{t_end - t_timed:.0f} s; load average over 1 min: {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores)")
    if retraced:
        print(f"  (retraced while timed: {', '.join(retraced)})")

    # The noise floor of this model: the same steps on one device, on the global
    # batch and split-sum; the variants sit within it if their distance from the
    # split-sum reference is below the floor.
    finals = {name: [np.asarray(p) for p in v.params()] for name, v in variants.items()}
    del variants, base, v
    single = single_device(x, y, steps_run, None)
    split = single_device(x, y, steps_run, len(devices()))
    floor, floor_n = differences(split, single)
    print(f"  noise floor after {steps_run} steps: |split-sum - single device| = {floor:.2e} "
          f"({floor_n:,} parameters > 1e-6)")
    for name, params in finals.items():
        d_split, n_split = differences(params, split)
        d_single, _ = differences(params, single)
        print(f"  {name}: |{name} - split-sum| = {d_split:.2e} ({n_split:,} > 1e-6), "
              f"|{name} - single device| = {d_single:.2e}: "
              f"{'within' if d_split <= floor else 'NOT within'} the noise floor")


if __name__ == "__main__":
    main()
