"""An MLP on MNIST or Fashion-MNIST with fleet.Model: no code change to go distributed.

Paddle's high-level ``paddle.Model`` in JAX, with the seed's settings by default:
the 784-512-ReLU-Dropout(0.2)-10 network, Adam (learning rate 1e-3), batch 32 per
device, 5 epochs. The same file runs on one process, data-parallel over every
local device, and on several processes::

    python examples/mnist/train.py --dataset fashion             # Debian's dataset-fashion-mnist
    python examples/mnist/train.py --data-dir ~/data/mnist        # any MNIST-format IDX files
    fleetrun --nproc_per_node 2 examples/mnist/train.py --dataset fashion
    python examples/mnist/train.py --dataset fashion --amp        # bfloat16 mixed precision

``--batch-size`` is per device, as in Paddle where it is per card: the global batch
is ``batch_size x devices``. ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
fakes 4 devices on a CPU. ``--amp`` turns on ``strategy.amp`` (bfloat16): the layers
compute in bfloat16, the parameters and the loss stay float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import optax
from data import DataError, default_dir, load  # examples/mnist/data.py
from flax import nnx

import fleet
from fleet.io import TensorDataset

NAMES = {"mnist": "MNIST", "fashion": "Fashion-MNIST"}


def plural(n: int, word: str) -> str:
    """``1 device``, ``2 devices``, ``1 process``, ``2 processes``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


class MLP(nnx.Module):
    """Flatten -> Linear(784, 512) -> ReLU -> Dropout(0.2) -> Linear(512, 10)."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.2):
        self.linear1 = nnx.Linear(784, 512, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.linear2 = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def dataset(data_dir: str, split: str, limit: int | None) -> TensorDataset:
    images, labels = load(data_dir, split)
    images, labels = images[:limit], labels[:limit]
    return TensorDataset([(images.astype(np.float32) - 127.5) / 127.5, labels.astype(np.int32)])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=sorted(NAMES), default="mnist")
    p.add_argument("--data-dir", help="directory with the four IDX files (.gz or not); "
                   "default for --dataset fashion: /usr/share/datasets/fashion-mnist")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="samples per device per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.2,
                   help="dropout rate (the seed's 0.2; each replica draws its own masks, so "
                        "only --dropout 0 trains exactly the single-device model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true",
                   help="bfloat16 mixed precision (strategy.amp; parameters stay float32)")
    p.add_argument("--num-train", type=int, help="train on the first N images only")
    p.add_argument("--log-freq", type=int, default=100)
    p.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--metrics-out", help="write the final metrics here (JSON)")
    return p.parse_args(argv)


def strategy_of(args: argparse.Namespace) -> fleet.DistributedStrategy:
    """The run's strategy: ``--amp`` turns on ``strategy.amp`` (bfloat16 by default)."""
    strategy = fleet.DistributedStrategy()
    strategy.amp = args.amp
    return strategy


def main(argv=None) -> dict:
    args = parse_args(argv)
    data_dir = args.data_dir or default_dir(args.dataset)
    if data_dir is None:
        hint = ("install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
                if args.dataset == "fashion" else
                "or use --dataset fashion with Debian's dataset-fashion-mnist")
        sys.exit(f"error: no {NAMES[args.dataset]} data: pass --data-dir DIR with the IDX "
                 f"files, {hint}")
    try:
        train_set = dataset(data_dir, "train", args.num_train)
        test_set = dataset(data_dir, "test", None)
    except DataError as e:
        sys.exit(f"error: {e}")

    fleet.init(is_collective=True, strategy=strategy_of(args))
    model = fleet.Model(MLP(nnx.Rngs(args.seed), args.dropout))
    model.prepare(optax.adam(args.lr), optax.softmax_cross_entropy_with_integer_labels,
                  fleet.metric.Accuracy())
    model.fit(train_set, test_set, batch_size=args.batch_size, epochs=args.epochs,
              log_freq=args.log_freq, verbose=args.verbose)
    result = model.evaluate(test_set, batch_size=args.batch_size, verbose=0)
    summary = {
        "dataset": NAMES[args.dataset], "devices": fleet.num_replicas(),
        "processes": fleet.worker_num(), "global_batch": args.batch_size * fleet.num_replicas(),
        "train_images": len(train_set), "test_images": len(test_set),
        "amp": "bfloat16" if args.amp else None, **result,
    }
    if fleet.is_first_worker():
        print(f"test accuracy: {result['acc']:.4f}  loss: {result['loss'][0]:.4f}  "
              f"({NAMES[args.dataset]}, {len(test_set)} images, "
              f"{plural(summary['devices'], 'device')}, "
              f"{plural(summary['processes'], 'process')}{', bfloat16 amp' if args.amp else ''})",
              flush=True)
        if args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
