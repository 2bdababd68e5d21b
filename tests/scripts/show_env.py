"""A plain worker that prints the variables a launcher gives it."""

import os

for name in ("FLEET_RANK", "CUDA_VISIBLE_DEVICES", "FLEET_JOB_ID"):
    print(f"{name}={os.environ.get(name)}", flush=True)
for name in sorted(os.environ):
    if name.startswith("PADDLE_"):
        print(f"{name}={os.environ[name]}", flush=True)
