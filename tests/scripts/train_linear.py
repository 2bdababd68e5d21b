"""A fleetrun worker: trains LinearNet; rank 0 saves the parameters to argv[1] (.npz)."""

import sys

import numpy as np
from linear_common import train_fleet

import fleet

result = train_fleet()
if fleet.is_first_worker():
    np.savez(sys.argv[1], **result)
