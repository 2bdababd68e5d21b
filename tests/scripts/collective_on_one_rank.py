"""A fleetrun worker where rank 0 makes a collective call that rank 1 never makes
(Paddle's habit ``if rank == 0: ...`` around a call that needs every process), before
any step: rank 0 waits in the barrier, rank 1 waits for rank 0. No step ever starts."""

import time

import fleet

fleet.init(is_collective=True)
if fleet.worker_index() == 0:
    print("rank 0 enters a barrier alone", flush=True)
    fleet.barrier_worker()
else:
    print("rank 1 waits for rank 0", flush=True)
    while True:
        time.sleep(1)
