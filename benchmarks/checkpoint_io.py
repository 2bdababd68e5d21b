"""Benchmark: saving and restoring a 25M-parameter training state, sync vs async,
with and without the integrity check (a CRC-32 of every array, summed on save,
verified on restore).

An MLP of 25.3M parameters (784 -> 4096 -> 4096 -> 1024 -> 1024 -> 10) with
Adam (three float32 copies: 289 MB of state), replicated on 4 CPU devices
(``--devices``), written to ``--dir`` (a temporary directory by default, on the
disk of this machine). Each round, interleaved:

* sync save: ``CheckpointManager(async_save=False).save`` until committed;
* async save: the time ``save`` blocks the training loop (device-to-host copy,
  metadata), and the time until the step is committed in the background
  while training goes on;
* restore: ``restore`` of model and optimizer (read, placed on the mesh);
* ``fleet.save`` / ``fleet.load`` of the model's state dict (100 MB);
* step time: the median step with no save running, and the median step while an
  asynchronous save is being written (training goes on meanwhile).

Every save and restore is timed twice each round, with the integrity check and
without it (in alternating order); the table shows the medians over
``--rounds`` rounds side by side, and their ratio (the check's cost: reading
every byte back and hashing it; ``fleet.load``'s ratio is large because
loading without the check is a bare read from the page cache).

    .venv/bin/python benchmarks/checkpoint_io.py [--rounds 3] [--devices 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--devices", type=int, default=4, help="CPU devices to fake")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--batch", type=int, default=64, help="global batch")
parser.add_argument("--dir", help="where to write (default: a temporary directory)")
args = parser.parse_args()

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fleet  # noqa: E402
from fleet.checkpoint import CheckpointManager, _integrity, load, save  # noqa: E402

SIZES = (784, 4096, 4096, 1024, 1024, 10)  # 25.3M parameters


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(SIZES[:-1], SIZES[1:])]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def train_step(model, optimizer, x, y):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    fleet.init(is_collective=True)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    model = fleet.distributed_model(model)
    optimizer = fleet.distributed_optimizer(optimizer)
    step = fleet.distributed_step(train_step)
    rng = np.random.RandomState(0)
    x = rng.randn(args.batch, SIZES[0]).astype(np.float32)
    y = rng.randint(0, 10, args.batch).astype(np.int32)

    def one_step():
        float(step(model, optimizer, x, y))

    one_step()  # compile
    params = sum(v.size for v in model.state_dict().values())
    state_mb = 3 * params * 4 / 2**20
    root = args.dir or tempfile.mkdtemp(prefix="fleet-ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    rows: dict[str, list[float]] = {}
    checked: dict[str, dict[bool, list[float]]] = {}

    def record(name, seconds):
        rows.setdefault(name, []).append(seconds)

    def record_checked(name, check, seconds):
        checked.setdefault(name, {True: [], False: []})[check].append(seconds)

    def saves_and_restores(r, check):
        """Sync save, restore, async save and fleet.save / fleet.load, with or
        without the integrity check."""
        _integrity.ENABLED = check
        name = f"checked-{check}"
        for kind in ("sync", "async"):
            shutil.rmtree(os.path.join(root, name, kind), ignore_errors=True)
        with CheckpointManager(os.path.join(root, name, "sync"), async_save=False) as manager:
            record_checked("sync save (until committed)", check,
                           timed(manager.save, r, model=model, optimizer=optimizer))
            record_checked("restore (model + optimizer)", check,
                           timed(manager.restore, r, model=model, optimizer=optimizer))
        with CheckpointManager(os.path.join(root, name, "async")) as manager:
            start = time.perf_counter()
            manager.save(r, model=model, optimizer=optimizer)
            record_checked("async save: blocks the loop", check, time.perf_counter() - start)
            manager.wait_until_finished()
            record_checked("async save: until committed", check, time.perf_counter() - start)
        path = os.path.join(root, name, "model.pdparams")
        record_checked("fleet.save(state_dict) 100 MB", check, timed(save, model.state_dict(), path))
        record_checked("fleet.load", check, timed(load, path))
        _integrity.ENABLED = True

    print(f"{params / 1e6:.1f}M parameters, {state_mb:.0f} MB with Adam's state, "
          f"{args.devices} CPU devices ({os.cpu_count()} cores), writing to {root}", flush=True)
    for r in range(args.rounds):
        for check in ((True, False) if r % 2 == 0 else (False, True)):
            saves_and_restores(r, check)
        shutil.rmtree(os.path.join(root, "async"), ignore_errors=True)
        with CheckpointManager(os.path.join(root, "async")) as manager:
            baseline = [timed(one_step) for _ in range(5)]
            manager.save(r, model=model, optimizer=optimizer)
            during = []
            while manager.is_saving():
                during.append(timed(one_step))
            manager.wait_until_finished()
            record("step, no save running", statistics.median(baseline))
            if during:
                record("step, async save running", statistics.median(during))
            rows.setdefault("steps taken during the async save", []).append(len(during))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    sizes = {"sync save (until committed)": state_mb, "restore (model + optimizer)": state_mb,
             "async save: until committed": state_mb,
             "fleet.save(state_dict) 100 MB": state_mb / 3, "fleet.load": state_mb / 3}
    print(f"\n| {'operation':40} | {'checked':>10} | {'MB/s':>6} | {'unchecked':>10} | "
          f"{'MB/s':>6} | {'ratio':>5} |")
    print(f"| {'-' * 40} | {'-' * 9}: | {'-' * 5}: | {'-' * 9}: | {'-' * 5}: | {'-' * 4}: |")
    for name, both in checked.items():
        on, off = statistics.median(both[True]), statistics.median(both[False])
        rate_on, rate_off = ((f"{sizes[name] / v:6.0f}" for v in (on, off)) if name in sizes
                             else (" " * 6, " " * 6))
        print(f"| {name:40} | {on * 1e3:>7.0f} ms | {rate_on} | {off * 1e3:>7.0f} ms | "
              f"{rate_off} | {on / off:5.2f} |")
    print("\nratio: time with the integrity check / time without it (medians)")
    print(f"\n| {'operation (checked)':40} | {'median':>10} |")
    print(f"| {'-' * 40} | {'-' * 9}: |")
    for name, values in rows.items():
        value = statistics.median(values)
        if name.startswith("steps taken"):
            print(f"| {name:40} | {value:>10.0f} |")
            continue
        print(f"| {name:40} | {value * 1e3:>7.0f} ms |")
    base = statistics.median(rows["step, no save running"])
    if "step, async save running" in rows:
        slow = statistics.median(rows["step, async save running"]) / base
        print(f"\nsteps run {slow:.2f}x as long while an asynchronous save is being written")


if __name__ == "__main__":
    main()
