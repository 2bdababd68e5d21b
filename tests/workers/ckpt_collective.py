"""A fleetrun worker for the multi-process checkpoint cases of issue 10.

    ckpt_collective.py CASE DIR

CASE:
  save-rank1       rank 1 alone calls fleet.save; then every rank loads it.
  save-all         every rank calls fleet.save to one path, three times over; then
                   rank 0 and, after it, rank 1.
  manager-rank0    ``CheckpointManager(d) if fleet.is_first_worker() else None``.
  save-rank0       every rank makes the manager; rank 0 alone calls save.
  restore-damaged  a 2-process job restores the latest of DIR/ckpt, whose newest
                   step has a flipped byte (set up by the test).

Rank 0 writes what it loaded to DIR/loaded-<rank>.npz for the test to compare
bitwise with DIR/expected.npz (written by rank 0 from its own values).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import fleet  # noqa: E402
from fleet.checkpoint import CheckpointManager, load, save  # noqa: E402


def state() -> dict:
    rs = np.random.RandomState(3)
    w = jax.device_put(rs.randn(64, 32).astype(np.float32), fleet.world().replicated)
    return {"w": w, "b": rs.randn(32).astype(np.float16), "step": np.int64(7),
            "nested": {"k": jax.random.key_data(jax.random.key(5))}}


def flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(v.addressable_shards[0].data
                                                if isinstance(v, jax.Array) else v)
            for p, v in leaves}


def main() -> None:
    case, directory = sys.argv[1], sys.argv[2]
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    path = os.path.join(directory, "model.pdparams")
    values = state()  # (every rank: placing an array on every process's devices is collective)
    if case in ("save-rank1", "save-all"):
        if rank == 0:
            np.savez(os.path.join(directory, "expected.npz"), **flat(values))
        for _ in range(3 if case == "save-all" else 1):
            if case == "save-all" or rank == 1:
                save(values, path)  # save-all: every rank at once
            fleet.barrier_worker()
        if case == "save-all":  # then rank 0, and rank 1 last (over a good checkpoint)
            for saver in (0, 1):
                if rank == saver:
                    save(values, path)
                fleet.barrier_worker()
        np.savez(os.path.join(directory, f"loaded-{rank}.npz"), **flat(load(path)))
        fleet.barrier_worker()
        print("leftovers:", sorted(os.listdir(directory)), flush=True)
    elif case == "manager-rank0":
        start = time.monotonic()
        mgr = CheckpointManager(directory) if fleet.is_first_worker() else None
        print(f"rank {rank}: manager {mgr} after {time.monotonic() - start:.0f} s", flush=True)
    elif case == "save-rank0":
        mgr = CheckpointManager(directory, async_save=False)
        if fleet.is_first_worker():
            mgr.save(1, state={"w": values["w"]})
        print(f"rank {rank}: saved", flush=True)
    elif case == "restore-damaged":
        template = {"w": jax.device_put(np.zeros((64, 32), np.float32), fleet.world().replicated)}
        with CheckpointManager(os.path.join(directory, "ckpt")) as mgr:
            restored = mgr.restore_latest(state=template)
            print(f"rank {rank}: restored step {restored.step}", flush=True)
            np.savez(os.path.join(directory, f"loaded-{rank}.npz"), **flat(restored.state))
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
