"""A plain worker (no JAX): rank 1 fails as asked; rank 0 sleeps (to be stopped)."""

import os
import sys
import time

rank = int(os.environ["FLEET_RANK"])
print(f"rank {rank} starts", flush=True)
if rank == 1:
    if sys.argv[1] == "raise":
        raise ValueError("boom from rank 1")
    sys.exit(int(sys.argv[1]))
time.sleep(60)
