"""A checkpointing training worker (one process of a job, or a job by itself).

    ckpt_train.py --steps 14 [--devices N] [--dir D --save-every K --save-seconds S]
                  [--resume]
                  [--restore DIR:STEP] [--probe DIR:STEP:OUT] [--dump STEP:OUT ...]
                  [--out OUT] [--kill-at S] [--hang-commit S] [--big N] [--sync]

--dir / --save-every / --save-seconds: save into D every K steps or S seconds
    (and the last step).
--resume: first restore the latest step of D (a restarted job).
--restore: first restore DIR at STEP.
--probe: before training, restore DIR at STEP into a fresh job, write its
    snapshot to OUT, and after one more step to OUT.next.npz.
--dump / --out: write the snapshot after STEP / at the end (process 0).
--kill-at: on the first run (FLEET_RESTART_COUNT 0) the last process kills
    itself with SIGKILL after step S.
--hang-commit: saving step S hangs at orbax's final rename (prints COMMIT-HANG).
--big: the checkpoint also holds an N-float array (a large, slow save).
--sync: no asynchronous save.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

import fleet  # noqa: E402
from fleet.checkpoint import CheckpointManager  # noqa: E402
from tests.workers import ckpt_common  # noqa: E402


def hang_at_commit(step: int) -> None:
    """Makes orbax's commit of ``step`` hang: the rename of its finished temporary
    directory (``<step>.orbax-checkpoint-tmp-*``, commit_success.txt written) to
    ``<step>``."""
    from orbax.checkpoint._src.path import async_path

    rename = async_path.rename

    async def hanging_rename(src, dst):
        if os.path.basename(str(src)).split(".")[0] != str(step):
            return await rename(src, dst)
        print(f"COMMIT-HANG {src}", flush=True)
        while True:
            time.sleep(1)

    async_path.rename = hanging_rename


def write(path: str, snap: dict) -> None:
    if fleet.is_first_worker():
        np.savez(path + ".tmp.npz", **snap)
        os.replace(path + ".tmp.npz", path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--devices", type=int)
    p.add_argument("--dir")
    p.add_argument("--save-every", type=int)
    p.add_argument("--save-seconds", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--restore")
    p.add_argument("--probe")
    p.add_argument("--dump", action="append", default=[])
    p.add_argument("--out")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--hang-commit", type=int)
    p.add_argument("--big", type=int, default=0)
    p.add_argument("--sync", action="store_true")
    args = p.parse_args()

    devices = jax.devices()[:args.devices] if args.devices else None
    fleet.init(is_collective=True, devices=devices)
    if args.hang_commit is not None:
        hang_at_commit(args.hang_commit)
    restart = int(os.environ.get("FLEET_RESTART_COUNT", "0"))
    print(f"rank {fleet.worker_index()} restart {restart}", flush=True)

    if args.probe:
        directory, step, out = args.probe.split(":")
        probe = ckpt_common.build()
        with CheckpointManager(directory) as source:
            probe.restore(source, int(step))
        write(out, ckpt_common.snapshot(probe))
        write(out + ".next.npz", ckpt_common.snapshot(ckpt_common.train(probe, probe.step + 1)))

    job = ckpt_common.build()
    if args.restore:
        directory, step = args.restore.split(":")
        with CheckpointManager(directory) as source:
            job.restore(source, int(step))
    manager = None
    if args.dir:
        manager = CheckpointManager(args.dir, save_interval_steps=args.save_every,
                                    save_interval_seconds=args.save_seconds,
                                    max_to_keep=3, async_save=False if args.sync else None)
        if args.resume:
            job.restore(manager)
            print(f"resumed at step {job.step}", flush=True)
    if args.big:
        big = np.random.RandomState(1).rand(args.big).astype(np.float32)
        save = manager.save

        def save_with_big(step, **kwargs):
            return save(step, **kwargs, state={"big": big})

        manager.save = save_with_big

    def after_step(job):
        print(f"step {job.step}", flush=True)
        for dump in args.dump:
            if job.step == int(dump.split(":")[0]):
                write(dump.split(":")[1], ckpt_common.snapshot(job))
        if job.step == args.kill_at and restart == 0 and fleet.worker_index() == fleet.worker_num() - 1:
            print("killing myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    ckpt_common.train(job, args.steps, manager, after_step)
    if manager is not None:  # the last step, whatever the interval
        manager.save(job.step, **job.parts(), metadata={"job": "ckpt", "step": job.step},
                     force=True)
        manager.close()
    if args.out:
        write(args.out, ckpt_common.snapshot(job))
    fleet.barrier_worker()
    print("done", flush=True)


if __name__ == "__main__":
    main()
