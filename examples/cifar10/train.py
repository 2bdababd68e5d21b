"""A CNN on CIFAR-10 with fleet's four-step API (the seed's Fleet example, in JAX).

One process, data-parallel over its devices, or several processes, unchanged::

    python examples/cifar10/train.py                             # all local devices
    fleetrun --nproc_per_node 2 examples/cifar10/train.py        # 2 processes
    fleetrun --nproc_per_node 2 examples/cifar10/train.py --epochs 2 --train-size 20000
    python examples/cifar10/train.py --synthetic --epochs 1      # offline, generated data

The data (the official ``cifar-10-python.tar.gz`` or its extracted
``cifar-10-batches-py/``) comes from ``--data-dir``, else the cache directory
(``$FLEET_DATA_HOME/cifar10`` or ``~/.cache/fleet/cifar10``); when it is not there
it is downloaded, MD5-checked and written atomically (see ``data.py``). When the
download fails with no ``--data-dir`` given (a machine without the network), the
script trains on generated data instead, says so in a banner at the start and
ends every accuracy line with "(synthetic data)"; with ``--data-dir`` it fails.
The cache remembers a download that could not reach the server for an hour: the
runs in between go to generated data at once, and the banner says when the next
run tries again.

Two speeds: the progress bar's last line (``samples/s``) counts the whole epoch,
the first step's compilation included; the validation line's ``images/s`` counts
the epoch after that first step (the rate of the steps that follow).

Training: random crop (4 pixels of zero padding) and horizontal flip, drawn per
image from ``(seed, epoch, image index)`` on the device, so every split of the
global batch over devices and processes augments alike; Adam; softmax
cross-entropy. After every epoch, the validation loss and accuracy are exact
(every test image once: the sampler's padding is dropped). The first worker
prints and writes ``metrics.json`` and ``curves.png`` to ``--output-dir``.

``--batch-size`` is per device (Paddle's per-card batch): the global batch is
``batch_size x devices``.

Checkpoints: ``--save-dir DIR`` saves the whole training state (model, optimizer,
loader position, step, epoch, history) every ``--save-every`` steps and at the
end of every epoch, keeping the last three; ``--resume`` continues from the
newest one exactly where it stopped, mid-epoch too. Under
``fleetrun --max_restarts N ... --save-dir DIR --resume`` a job that loses a
worker restarts and goes on as if it had never stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import data  # examples/cifar10/data.py
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import fleet  # 1. import fleet
from fleet.hapi import ProgressBar
from fleet.io import DataLoader, DistributedBatchSampler, TensorDataset

URL_ENV = "FLEET_CIFAR10_URL"  # another download address (a mirror)
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32) * 255
STD = np.array([0.2470, 0.2435, 0.2616], np.float32) * 255


class MyNet(nnx.Module):
    """The seed's network: three 3x3 convolutions (two max-pooled), two linear layers."""

    def __init__(self, rngs: nnx.Rngs, num_classes: int = 10):
        self.conv1 = nnx.Conv(3, 32, (3, 3), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding="VALID", rngs=rngs)
        self.conv3 = nnx.Conv(64, 64, (3, 3), padding="VALID", rngs=rngs)
        self.linear1 = nnx.Linear(4 * 4 * 64, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))  # 30 -> 15
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))  # 13 -> 6
        x = nnx.relu(self.conv3(x))  # 4x4x64 = 1024
        x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
        return self.linear2(x)


class Block(nnx.Module):
    """A residual block: two 3x3 convolutions with BatchNorm, a 1x1 projection when
    the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.project = (nnx.Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs)
                        if stride != 1 or cin != cout else None)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return nnx.relu(y + (x if self.project is None else self.project(x)))


class ResNet(nnx.Module):
    """A small ResNet for 32x32 images (ResNet-8: a stem and three residual stages of
    16, 32 and 64 channels), BatchNorm after every convolution."""

    def __init__(self, rngs: nnx.Rngs, num_classes: int = 10, width: int = 16):
        self.stem = nnx.Conv(3, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
        self.stage1 = Block(width, width, 1, rngs)
        self.stage2 = Block(width, 2 * width, 2, rngs)
        self.stage3 = Block(2 * width, 4 * width, 2, rngs)
        self.head = nnx.Linear(4 * width, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.stem(x)))
        x = self.stage3(self.stage2(self.stage1(x)))
        return self.head(x.mean(axis=(1, 2)))


MODELS = {"cnn": MyNet, "resnet": ResNet}


def normalize(images):
    return (images.astype(jnp.float32) - MEAN) / STD


def augment(images, index, seed, epoch):
    """Random 32x32 crop of the zero-padded 40x40 image, and a coin-flip mirror; the
    randomness of each image comes from (seed, epoch, its dataset index)."""
    base = jax.random.fold_in(jax.random.key(seed), epoch)

    def one(image, i):
        k_crop, k_flip = jax.random.split(jax.random.fold_in(base, i))
        padded = jnp.pad(image, ((4, 4), (4, 4), (0, 0)))
        dy, dx = jax.random.randint(k_crop, (2,), 0, 9)
        crop = jax.lax.dynamic_slice(padded, (dy, dx, 0), (32, 32, 3))
        return jnp.where(jax.random.bernoulli(k_flip), crop[:, ::-1], crop)

    return jax.vmap(one)(images, index)


def train_step(model, optimizer, images, labels, index, seed, epoch):
    x = normalize(augment(images, index, seed, epoch))

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def eval_step(model, images, labels):
    logits = model(normalize(images))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses, logits.argmax(-1) == labels  # per example: gathered, exact


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    p.add_argument("--model", choices=sorted(MODELS), default="cnn",
                   help="cnn: the seed's network; resnet: a small ResNet with BatchNorm")
    p.add_argument("--per-replica-bn", action="store_true",
                   help="resnet: each replica normalises with its own rows (DDP's "
                   "BatchNorm) instead of the global batch (strategy.sync_batch_norm)")
    p.add_argument("--data-dir", help="directory with cifar-10-python.tar.gz or "
                   "cifar-10-batches-py/ (default: the cache directory)")
    p.add_argument("--synthetic", action="store_true",
                   help="train on generated CIFAR-shaped data (no download)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=32, help="images per device per step")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0,
                   help="the model's initialisation and the augmentation")
    p.add_argument("--train-size", type=int, help="use the first N training images "
                   "(with --synthetic: generate N; default 50000)")
    p.add_argument("--test-size", type=int, help="use the first N test images "
                   "(with --synthetic: generate N; default 10000)")
    p.add_argument("--num-workers", type=int, default=0, help="loader worker processes")
    p.add_argument("--log-freq", type=int, default=50, help="progress every N steps")
    p.add_argument("--output-dir", default="output/cifar10",
                   help="where the first worker writes metrics.json and curves.png")
    p.add_argument("--url", default=os.environ.get(URL_ENV) or data.URL,
                   help=f"where to download the archive from (default: ${URL_ENV}, else "
                   "the official address)")
    p.add_argument("--md5", default=data.MD5, help="the archive's expected MD5")
    p.add_argument("--save-dir", help="save checkpoints here (whole training state)")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --save-dir, if there is one")
    p.add_argument("--max-steps", type=int,
                   help="stop after this many steps in all (a short run; saves first)")
    args = p.parse_args(argv)
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir (where the checkpoints are)")
    return args


SYNTHETIC = " (synthetic data)"


def plural(n: int, word: str) -> str:
    """``1 device``, ``2 devices``, ``1 process``, ``2 processes``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def offline_banner(reason: str) -> str:
    """The banner of a run on generated data: ``reason`` says why (without advice:
    the banner gives it once)."""
    rule = "=" * 78
    return (f"{rule}\nNO CIFAR-10 ON THIS MACHINE: TRAINING ON GENERATED DATA\n{reason}.\n"
            "Every number below is measured on generated CIFAR-shaped images, not on "
            "CIFAR-10.\nFor the real data, run once with the network, or pass "
            f"--data-dir DIR with {data.ARCHIVE} (or {data.DIRNAME}/) in DIR.\n{rule}")


def load_data(args, world) -> tuple[dict, str]:
    """The train / test arrays and a note for log lines ("" or " (synthetic data)").

    ``--data-dir DIR``: the data must be there or be downloaded there, else the
    script fails. By default (the cache directory), a download that fails (no
    network) falls back to generated data, with a banner; a corrupt file in the
    cache still fails (delete it to download it again)."""
    limits = {"train": args.train_size, "test": args.test_size}
    if args.synthetic:
        return data.synthetic(args.train_size or 50000, args.test_size or 10000), SYNTHETIC
    explicit = args.data_dir is not None
    root = Path(args.data_dir) if explicit else data.default_cache()
    found, problem = data.locate(root), None
    if found is None:
        # A failed download into the cache is remembered for an hour (data.RETRY_AFTER).
        recent = None if explicit else data.recent_offline(root, args.url)
        if world.env.local_rank == 0 and recent is not None:
            problem = f"the last download failed: {recent}"
        elif world.env.local_rank == 0:  # one download per machine; the others wait
            print(f"CIFAR-10 is not in {root}: downloading {args.url}", flush=True)
            try:
                data.download(args.url, root / data.ARCHIVE, args.md5)
                data.forget_offline(root)
            except data.OfflineError as e:
                if explicit:
                    sys.exit(f"error: {e}")
                problem = e.what
                data.remember_offline(root, args.url, e.what)
            except data.DataError as e:
                if explicit:
                    sys.exit(f"error: {e}")
                problem = str(e).rstrip(".")
        fleet.barrier_worker()
        found = data.locate(root)
    # Every process trains on the same kind of data, or none trains.
    have = multihost_utils.process_allgather(np.int32(found is not None)).reshape(-1).tolist()
    if len(set(have)) > 1:
        sys.exit(f"error: processes {[r for r, h in enumerate(have) if h]} have CIFAR-10 and "
                 f"{[r for r, h in enumerate(have) if not h]} could not download it; give every "
                 "machine the data (--data-dir DIR), or train on --synthetic data")
    if found is None:
        if fleet.is_first_worker():
            reason = problem or f"the download on this machine failed (see {root})"
            print(offline_banner(reason), flush=True)
        return data.synthetic(args.train_size or 50000, args.test_size or 10000), SYNTHETIC
    try:
        splits = data.read(found, md5=args.md5)
    except data.DataError as e:
        sys.exit(f"error: {e}")
    return {k: (x[:limits[k]], y[:limits[k]]) for k, (x, y) in splits.items()}, ""


def main(argv=None) -> dict:
    began = time.perf_counter()
    args = parse_args(argv)
    strategy = fleet.DistributedStrategy(sync_batch_norm=not args.per_replica_bn)
    world = fleet.init(is_collective=True, strategy=strategy)  # 2. the data-parallel world
    first = fleet.is_first_worker()
    splits, note = load_data(args, world)

    model = MODELS[args.model](nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    model = fleet.distributed_model(model)  # 3. the model and the optimizer
    optimizer = fleet.distributed_optimizer(optimizer)
    step = fleet.distributed_step(train_step)  # 4. instead of nnx.jit
    evaluate = fleet.distributed_step(eval_step)

    # 5. the loaders: each device gets its own batch_size images of every global batch.
    (x_train, y_train), (x_test, y_test) = splits["train"], splits["test"]
    train_set = TensorDataset([x_train, y_train, np.arange(len(x_train), dtype=np.int32)])
    test_set = TensorDataset([x_test, y_test])
    train_loader = DataLoader(train_set, batch_sampler=DistributedBatchSampler(
        train_set, args.batch_size, shuffle=True, drop_last=True), num_workers=args.num_workers)
    valid_loader = DataLoader(test_set, batch_sampler=DistributedBatchSampler(
        test_set, args.batch_size), num_workers=args.num_workers)
    global_batch = args.batch_size * world.num_replicas
    if first:
        bn = ("" if args.model != "resnet" else
              "; BatchNorm per replica" if args.per_replica_bn else
              "; BatchNorm over the global batch")
        print(f"CIFAR-10{note}: {args.model}{bn}; {len(train_set)} training and "
              f"{len(test_set)} test images; "
              f"{plural(world.num_replicas, 'device')} in "
              f"{plural(fleet.worker_num(), 'process')}; global batch "
              f"{global_batch}", flush=True)

    history, global_step, start_epoch = [], 0, 0
    manager = None
    if args.save_dir:
        manager = fleet.CheckpointManager(args.save_dir, max_to_keep=3,
                                          save_interval_steps=args.save_every)
    if args.resume:
        restored = manager.restore_latest(model=model, optimizer=optimizer, loader=train_loader)
        if restored is not None:
            global_step, start_epoch = restored.step, restored.epoch
            history = restored.metadata["history"]
            if first:
                print(f"resumed from step {global_step} (epoch {start_epoch + 1}) in "
                      f"{args.save_dir}", flush=True)

    def save(epoch: int, force: bool = False) -> None:
        if manager is not None:
            manager.save(global_step, model=model, optimizer=optimizer, loader=train_loader,
                         epoch=epoch, metadata={"history": history}, force=force)

    for epoch in range(start_epoch, args.epochs):
        bar = ProgressBar(len(train_loader), verbose=1, suffix=note.strip())
        if first:
            print(f"Epoch {epoch + 1}/{args.epochs}", flush=True)
        seen, window, started, losses = 0, 0, None, []
        # After --resume mid-epoch the loader goes on from the next batch: count on.
        offset = min(max(global_step - epoch * len(train_loader), 0), len(train_loader))
        for i, (images, labels, index) in enumerate(train_loader, start=offset):
            loss = step(model, optimizer, images, labels, index, args.seed, epoch)
            losses.append(loss)
            global_step += 1
            if args.max_steps is not None and global_step >= args.max_steps:
                break
            save(epoch)
            window += global_batch
            if i == offset:  # time the epoch from the end of the first (compiling) step
                loss.block_until_ready()
                started = time.perf_counter()
            else:
                seen += global_batch
            if (i + 1) % args.log_freq == 0 or i + 1 == len(train_loader):
                bar.update(i + 1, [("loss", float(loss))], window)
                window = 0
        if args.max_steps is not None and global_step >= args.max_steps:
            save(epoch, force=True)
            if first:
                print(f"stopped after {global_step} steps (--max-steps)", flush=True)
            break
        train_loss = float(jnp.mean(jnp.stack(losses)))  # (after a resume: the steps run since)
        elapsed = time.perf_counter() - started
        images_per_sec = seen / elapsed if seen else float("nan")

        model.eval()  # BatchNorm: the running statistics
        loss_sum, correct, count = 0.0, 0, 0
        for images, labels in valid_loader:
            per_loss, hits = valid_loader.gather_for_metrics(evaluate(model, images, labels))
            loss_sum += float(per_loss.sum(dtype=np.float64))
            correct += int(hits.sum())
            count += len(hits)
        model.train()
        record = {"epoch": epoch + 1, "train_loss": train_loss, "val_loss": loss_sum / count,
                  "val_accuracy": correct / count, "val_images": count,
                  "images_per_sec": images_per_sec, "first_step": offset,
                  "step_losses": [float(x) for x in losses]}
        history.append(record)
        if first:
            print(f"[validation] epoch {epoch + 1}/{args.epochs} accuracy/loss: "
                  f"{record['val_accuracy']:.4f}/{record['val_loss']:.4f} ({count} images; "
                  f"training {images_per_sec:.0f} images/s after the compiling first step)"
                  f"{note}", flush=True)
        save(epoch + 1, force=True)  # the loader stands at the next epoch's start
    if manager is not None:
        manager.close()

    result = {"synthetic": bool(note), "devices": world.num_replicas,
              "processes": fleet.worker_num(), "global_batch": global_batch,
              "epochs": history}
    if first:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out / 'metrics.json'}", flush=True)
        plot(history, out / "curves.png", note)
        print(f"done in {time.perf_counter() - began:.0f} s{note}", flush=True)
    return result


def plot(history: list[dict], path: Path, note: str) -> None:
    """Loss and accuracy curves; skipped (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the plot (pip install matplotlib, or "
              "pip install -e '.[examples]')", flush=True)
        return
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for h in history:  # every training step's loss, at its place in the epoch
        losses = h.get("step_losses", [])
        n = len(losses) + h.get("first_step", 0)
        x = [h["epoch"] - 1 + (h.get("first_step", 0) + i + 1) / n for i in range(len(losses))]
        ax_loss.plot(x, losses, color="C0", linewidth=0.8,
                     label="train (per step)" if h is history[0] else None)
    epochs = [h["epoch"] for h in history]
    ax_loss.plot(epochs, [h["val_loss"] for h in history], "o-", color="C1", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss" + note)
    ax_loss.legend()
    ax_acc.plot(epochs, [h["val_accuracy"] for h in history], "o-", color="C1")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1),
               xlim=(min(epochs, default=1) - 0.5, max(epochs, default=1) + 0.5),
               title="validation accuracy (each epoch)" + note)
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
