"""A script that ends while an asynchronous save is still being written.

    ckpt_exit.py MODE DIR OUT

It saves step 1 (small) and waits for it, then starts the asynchronous save of
step 2 (a 32 MB array, slow to write) and ends at once, without ``close()``:

  return       the script returns normally.
  raise        the script raises (a RuntimeError).
  disk-full    as ``return``, but writing step 2 fails with "No space left on
               device" (an injected ENOSPC at orbax's commit).
  tmpfs        DIR is a 2 MB tmpfs (the test mounts it): step 2 does not fit;
               the script checks what the manager says and what stays loadable.
  os-exit      as ``return``, but the script ends with ``os._exit(0)``, which
               skips every exit hook: nothing can finish step 2.

OUT/expected-<step>.npy hold the values saved, for the test to compare bitwise.
"""

import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import fleet  # noqa: E402
from fleet.checkpoint import CheckpointManager, FleetCheckpointError  # noqa: E402


def fail_commit_with_enospc() -> None:
    """orbax's final rename of a step fails as on a full disk."""
    from orbax.checkpoint._src.path import async_path

    async def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    async_path.rename = full


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    fleet.init(is_collective=True)
    rs = np.random.RandomState(0)
    small = rs.rand(1000).astype(np.float32)
    big = rs.rand(8_000_000 if mode != "tmpfs" else 1_000_000).astype(np.float32)
    expected = os.path.join(out, "expected-{}.npy")
    np.save(expected.format(1), small)
    np.save(expected.format(2), big)
    manager = CheckpointManager(directory)
    manager.save(1, state={"w": small})
    manager.wait_until_finished()
    if mode == "disk-full":
        fail_commit_with_enospc()
    if mode == "tmpfs":
        try:  # (synchronous on CPython 3.12.0-3.12.2: save(2) itself raises)
            manager.save(2, state={"w": big})  # 4 MB of random floats on a 2 MB disk
            manager.save(3, state={"w": small})
        except FleetCheckpointError as e:
            print(f"save({3 if manager.async_save else 2}) raised: {e}", flush=True)
        print("steps", manager.all_steps(), "files", sorted(os.listdir(directory)), flush=True)
        restored = manager.restore_latest(state={"w": np.zeros_like(small)})
        print("restored", restored.step, restored.state["w"].tobytes() == small.tobytes(),
              flush=True)
        manager.close()
        return
    manager.save(2, state={"w": big})
    print("saving step 2; ending without close()", flush=True)
    if mode == "os-exit":
        os._exit(0)
    if mode == "raise":
        raise RuntimeError("the training script failed")


if __name__ == "__main__":
    main()
