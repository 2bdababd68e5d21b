"""A worker (of any launcher): trains LinearNet; rank 0 saves the parameters to
argv[1] (.npz). It prints how many processes trained."""

import sys

import numpy as np
from linear_common import train_fleet

import fleet

result = train_fleet()
print(f"rank {fleet.worker_index()} of processes: {fleet.worker_num()}", flush=True)
if fleet.is_first_worker():
    np.savez(sys.argv[1], **result)
