"""A plain worker that prints the variables a launcher gives it."""

import os

for name in ("FLEET_RANK", "CUDA_VISIBLE_DEVICES", "FLEET_JOB_ID"):
    print(f"{name}={os.environ.get(name)}", flush=True)
