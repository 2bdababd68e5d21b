"""A fleetrun worker: joins the job, records the restart count it sees in argv[1];
on the first run (restart count 0) rank 1 fails after the first collective."""

import os
import sys

import fleet

fleet.init(is_collective=True)
fleet.barrier_worker()
count = fleet.world().env.restart_count
with open(sys.argv[1], "a") as f:
    f.write(f"rank {fleet.worker_index()} restart {count} "
            f"env {os.environ['FLEET_RESTART_COUNT']}\n")
if count == 0 and fleet.worker_index() == 1:
    sys.exit("rank 1 fails on the first run")
fleet.barrier_worker()
print("done", flush=True)
