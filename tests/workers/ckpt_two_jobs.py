"""One of two single-process jobs that write one checkpoint directory at once
(issue 22, item 3).

    ckpt_two_jobs.py DIR OUT TAG

It makes its CheckpointManager on DIR, or prints the error that refused it
("refused: ..."); then creates OUT/ready-TAG and waits (at most 60 s) for
OUT/go, which the test creates once both jobs are that far, so that both
managers exist before either saves. The job that holds the directory then
saves steps 1 to 8 asynchronously, each with values of its own (also written
to OUT/TAG-<step>.npy, for the test to compare bitwise), and closes it.
"""

import os
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import fleet  # noqa: E402
from fleet.checkpoint import CheckpointManager, FleetCheckpointError  # noqa: E402


def main() -> None:
    directory, out, tag = sys.argv[1:4]
    fleet.init(is_collective=True)
    try:
        manager = CheckpointManager(directory)
    except FleetCheckpointError as e:
        manager = None
        print(f"refused: {e}", flush=True)
    open(os.path.join(out, f"ready-{tag}"), "w").close()
    if manager is None:
        return
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "go")):
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.01)
    for step in range(1, 9):
        w = np.random.RandomState(zlib.crc32(tag.encode()) + step).rand(100_000).astype(np.float32)
        np.save(os.path.join(out, f"{tag}-{step}.npy"), w)
        manager.save(step, state={"w": w})
    manager.close()
    print(f"{tag}: saved steps 1 to 8", flush=True)


if __name__ == "__main__":
    main()
