"""Loader throughput: ``fleet.io.DataLoader`` against a raw numpy gather + ``device_put``.

Issue 3, acceptance 8. CIFAR-shaped in-memory data (50,000 x 32x32x3 uint8 images,
int32 labels), 4 CPU devices, per-device batch 256 (global 1,024). Measured side by
side in one run, interleaved round by round (A B B A ...) so drift hits both alike:

1. raw: for the sampler's index batches, ``images[idx]``, ``labels[idx]`` and
   ``jax.device_put(..., world.batch)``, waiting for each batch to be ready;
2. ``DataLoader(TensorDataset([images, labels]), batch_sampler=sampler)``, waiting
   for each batch to be ready (target: at least 0.9x of raw);
3. the same two with a simulated 5 ms device step per batch (a ``sleep``, which,
   like an accelerator step, leaves the CPU free): raw loads then steps, the loader
   loads the next batch during the step;
4. a per-sample random-crop (pad 4) + horizontal-flip transform on a
   ``Dataset.__getitem__``, with ``num_workers`` 0 against 2 (persistent workers;
   their start-up is timed separately).

Run: ``python benchmarks/loader_throughput.py [--rounds 5]``.
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

import fleet  # noqa: E402
from fleet.io import DataLoader, Dataset, DistributedBatchSampler, TensorDataset  # noqa: E402

NUM_IMAGES, PER_DEVICE_BATCH, STEP_S = 50_000, 256, 0.005


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


def raw_epoch(images, labels, batches, sharding, step_s=0.0) -> int:
    count = 0
    for idx in batches:
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


def paired(base, other, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """Images/s of ``base`` and ``other`` and their ratio, round by round (A B B A).

    Other jobs share these cores, so each round's ratio compares epochs run
    back to back; the table reports the median over rounds.
    """
    base_rates, other_rates, ratios = [], [], []
    for _ in range(rounds):
        seconds, images = {base: 0.0, other: 0.0}, {base: 0, other: 0}
        for fn in (base, other, other, base):
            start = time.perf_counter()
            images[fn] += fn()
            seconds[fn] += time.perf_counter() - start
        base_rates.append(images[base] / seconds[base])
        other_rates.append(images[other] / seconds[other])
        ratios.append(other_rates[-1] / base_rates[-1])
    return base_rates, other_rates, ratios


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

    sampler = DistributedBatchSampler(range(NUM_IMAGES), PER_DEVICE_BATCH, shuffle=True,
                                      drop_last=True)
    raw_sampler = DistributedBatchSampler(range(NUM_IMAGES), PER_DEVICE_BATCH, shuffle=True,
                                          drop_last=True)
    loader = DataLoader(TensorDataset([images, labels]), batch_sampler=sampler)

    def raw(step_s=0.0):  # the same batches as the loader's, epoch for epoch
        return lambda: raw_epoch(images, labels, raw_sampler.batches(next_epoch(raw_sampler)),
                                 world.batch, step_s)

    loader_epoch(loader), raw()()  # warm-up: first touches of every code path
    rows = []
    raw_rates, loader_rates, ratios = paired(raw(), lambda: loader_epoch(loader), args.rounds)
    rows += [("raw numpy gather + device_put", raw_rates, None),
             ("fleet.io.DataLoader (TensorDataset)", loader_rates, ratios)]
    raw_rates, loader_rates, ratios = paired(raw(STEP_S), lambda: loader_epoch(loader, STEP_S),
                                             max(2, args.rounds // 2))
    rows += [("raw, then a 5 ms step (sleep)", raw_rates, None),
             ("DataLoader + 5 ms step (overlapped)", loader_rates, ratios)]

    subset = CropFlipDataset(images[: args.transform_images], labels[: args.transform_images])
    serial = DataLoader(subset, batch_size=PER_DEVICE_BATCH, shuffle=True, drop_last=True)
    parallel = DataLoader(subset, batch_size=PER_DEVICE_BATCH, shuffle=True, drop_last=True,
                          num_workers=2, persistent_workers=True)
    start = time.perf_counter()
    loader_epoch(parallel)  # starts the workers
    first_epoch_s = time.perf_counter() - start
    serial_rates, parallel_rates, ratios = paired(lambda: loader_epoch(serial),
                                                  lambda: loader_epoch(parallel),
                                                  max(2, args.rounds // 4))
    parallel.close()
    rows += [("crop+flip per sample, num_workers=0", serial_rates, None),
             ("crop+flip per sample, num_workers=2", parallel_rates, ratios)]

    print(f"\nfleet.io loader throughput: {len(jax.devices())} CPU devices, per-device batch "
          f"{PER_DEVICE_BATCH} (global {PER_DEVICE_BATCH * world.num_replicas}), "
          f"{NUM_IMAGES:,} x 32x32x3 uint8, {os.cpu_count()} CPU cores, "
          f"{args.rounds} interleaved rounds\n")
    print(f"| {'case':<40} | {'images/s (median)':>17} | {'ratio (median)':>14} | "
          f"{'ratio min..max':>14} |")
    print(f"|{'-' * 42}|{'-' * 19}|{'-' * 16}|{'-' * 16}|")
    for name, rates, ratios in rows:
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "1.00x"
        spread = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else ""
        print(f"| {name:<40} | {statistics.median(rates):>17,.0f} | {ratio:>14} | "
              f"{spread:>14} |")
    print(f"\nratio: against the row above, per round (A B B A), median over rounds. "
          f"First workers epoch incl. start-up: {first_epoch_s:.2f} s for "
          f"{args.transform_images:,} images. Load average during the run: "
          f"{load_before:.2f} -> {os.getloadavg()[0]:.2f} (other jobs share these cores).")


def next_epoch(sampler: DistributedBatchSampler) -> int:
    epoch = sampler.epoch
    sampler.set_epoch(epoch + 1)
    return epoch


if __name__ == "__main__":
    main()
