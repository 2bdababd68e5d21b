"""Loader throughput: ``fleet.io.DataLoader`` against a raw numpy gather + ``device_put``.

Issue 3, acceptance 8. CIFAR-shaped in-memory data (50,000 x 32x32x3 uint8 images,
int32 labels), 4 CPU devices, per-device batch 256 (global 1,024). Every group of
cases runs side by side in one process, interleaved round by round (A B C C B A),
and each round's ratio compares epochs run back to back, so load from other jobs
on the machine hits all cases alike. Cases:

1. raw: for the sampler's index batches, ``jax.device_put((images[idx],
   labels[idx]), world.batch)``, waiting for each batch to be ready; against
   ``DataLoader(TensorDataset([images, labels]), batch_sampler=sampler)`` as it
   comes (the vectorised fast path, loading in the main thread), and with
   ``use_buffer_reader=True`` (a loading thread). Target: at least 0.9x of raw.
2. the same with a 5 ms blocking step per batch (a ``sleep``: a training loop
   that waits for every step, on an accelerator that leaves the CPU free).
3. a per-sample random-crop (pad 4) + horizontal-flip ``Dataset.__getitem__``,
   ``num_workers`` 0 against 2 (persistent workers; start-up timed separately).

"CPU us/image" adds up this process and its workers: it shows the cost of each way
of loading independently of how busy the machine is.

Run: ``.venv/bin/python benchmarks/loader_throughput.py [--rounds 12]`` (needs ``psutil``, from
the ``test`` extra).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

import fleet  # noqa: E402
from fleet.io import DataLoader, Dataset, DistributedBatchSampler, TensorDataset  # noqa: E402

NUM_IMAGES, PER_DEVICE_BATCH, STEP_S = 50_000, 256, 0.005
_ME = psutil.Process()


class CropFlipDataset(Dataset):
    """CIFAR training augmentation, one sample at a time: pad 4, random crop, random flip."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        padded = np.pad(self.images[i], ((4, 4), (4, 4), (0, 0)))
        dy, dx = np.random.randint(0, 9, size=2)
        image = padded[dy : dy + 32, dx : dx + 32]
        if np.random.rand() < 0.5:
            image = image[:, ::-1]
        return np.ascontiguousarray(image), self.labels[i]


def raw_epoch(images, labels, sampler, sharding, step_s=0.0) -> int:
    """One epoch of the sampler's batches, gathered and placed by hand."""
    epoch = sampler.epoch
    sampler.set_epoch(epoch + 1)
    count = 0
    for idx in sampler.batches(epoch):
        x, y = jax.device_put((images[idx], labels[idx]), sharding)
        jax.block_until_ready((x, y))
        if step_s:
            time.sleep(step_s)
        count += len(idx)
    return count


def loader_epoch(loader, step_s=0.0) -> int:
    count = 0
    for x, y in loader:
        jax.block_until_ready((x, y))
        if step_s:
            time.sleep(step_s)
        count += x.shape[0]
    return count


def cpu_seconds() -> float:
    """CPU time of this process and its live children (the loader's workers)."""
    total = 0.0
    for proc in [_ME, *_ME.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def interleaved(cases: dict[str, callable], rounds: int) -> list[tuple]:
    """Per case: images/s and CPU us/image by round, and the ratio to the first case.

    Each round runs the cases forwards, then backwards, one epoch each.
    """
    names = list(cases)
    rates = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for _ in range(rounds):
        seconds, images, used = ({n: 0.0 for n in names}, {n: 0 for n in names},
                                 {n: 0.0 for n in names})
        for name in names + names[::-1]:
            cpu_start, start = cpu_seconds(), time.perf_counter()
            images[name] += cases[name]()
            seconds[name] += time.perf_counter() - start
            used[name] += cpu_seconds() - cpu_start
        for n in names:
            rates[n].append(images[n] / seconds[n])
            cpu[n].append(used[n] / images[n] * 1e6)
    base = rates[names[0]]
    return [(n, rates[n], cpu[n], None if i == 0 else [r / b for r, b in zip(rates[n], base)])
            for i, n in enumerate(names)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--transform-images", type=int, default=16_384,
                        help="images per epoch in the per-sample transform cases")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    world = fleet.init(is_collective=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (NUM_IMAGES, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, NUM_IMAGES).astype(np.int32)
    dataset = TensorDataset([images, labels])

    def sampler():  # the same batches for every case, epoch for epoch
        return DistributedBatchSampler(dataset, PER_DEVICE_BATCH, shuffle=True, drop_last=True)

    raw_sampler = sampler()
    inline = DataLoader(dataset, batch_sampler=sampler())
    threaded = DataLoader(dataset, batch_sampler=sampler(), use_buffer_reader=True)
    for fn in (lambda: raw_epoch(images, labels, raw_sampler, world.batch),
               lambda: loader_epoch(inline), lambda: loader_epoch(threaded)):
        fn()  # warm-up: first touches of every code path

    groups = [interleaved({
        "raw numpy gather + device_put": lambda: raw_epoch(images, labels, raw_sampler,
                                                           world.batch),
        "DataLoader, TensorDataset (default)": lambda: loader_epoch(inline),
        "DataLoader, use_buffer_reader=True": lambda: loader_epoch(threaded),
    }, args.rounds)]
    groups.append(interleaved({
        "raw, then a 5 ms blocking step": lambda: raw_epoch(images, labels, raw_sampler,
                                                            world.batch, STEP_S),
        "DataLoader (default) + step": lambda: loader_epoch(inline, STEP_S),
        "DataLoader, use_buffer_reader=True + step": lambda: loader_epoch(threaded, STEP_S),
    }, max(2, args.rounds // 3)))

    subset = CropFlipDataset(images[: args.transform_images], labels[: args.transform_images])
    serial = DataLoader(subset, batch_size=PER_DEVICE_BATCH, shuffle=True, drop_last=True)
    parallel = DataLoader(subset, batch_size=PER_DEVICE_BATCH, shuffle=True, drop_last=True,
                          num_workers=2, persistent_workers=True)
    start = time.perf_counter()
    loader_epoch(parallel)  # starts the workers
    first_epoch_s = time.perf_counter() - start
    groups.append(interleaved({
        "crop+flip per sample, num_workers=0": lambda: loader_epoch(serial),
        "crop+flip per sample, num_workers=2": lambda: loader_epoch(parallel),
    }, max(2, args.rounds // 3)))
    parallel.close()

    print(f"\nfleet.io loader throughput: {len(jax.devices())} CPU devices, per-device batch "
          f"{PER_DEVICE_BATCH} (global {PER_DEVICE_BATCH * world.num_replicas}), "
          f"{NUM_IMAGES:,} x 32x32x3 uint8, {os.cpu_count()} CPU cores\n")
    print(f"| {'case':<42} | {'images/s':>10} | {'ratio':>6} | {'ratio range':>11} | "
          f"{'CPU us/image':>12} |")
    print(f"|{'-' * 44}|{'-' * 12}|{'-' * 8}|{'-' * 13}|{'-' * 14}|")
    for group in groups:
        for name, rates, cpu, ratios in group:
            ratio = f"{statistics.median(ratios):.2f}x" if ratios else "1.00x"
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
            print(f"| {name:<42} | {statistics.median(rates):>10,.0f} | {ratio:>6} | "
                  f"{spread:>11} | {statistics.median(cpu):>12.2f} |")
    print(f"\nMedians over rounds ({args.rounds}, {max(2, args.rounds // 3)}, "
          f"{max(2, args.rounds // 3)}); ratio: against the first row of its group, round "
          f"by round. First num_workers=2 epoch incl. worker start-up: {first_epoch_s:.2f} s "
          f"for {args.transform_images:,} images. Load average: {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f} (other jobs share these {os.cpu_count()} cores).")


if __name__ == "__main__":
    main()
