"""Minimal reproducer: XLA:CPU all-reduce deadlock on N fake CPU devices (no fleet).

    .venv/bin/python benchmarks/xla_cpu_allreduce_deadlock.py              # aborts (2-core machine)
    PJRT_NPROC=8 .venv/bin/python benchmarks/xla_cpu_allreduce_deadlock.py # completes

jax/jaxlib 0.10.2. A jitted shard_map with one psum, called in a loop that never
waits, on 4 fake CPU devices. On a machine with fewer cores than 2 x devices it
stops (0% CPU) once the loop is about 32 steps ahead of the devices, then aborts:

    F... rendezvous.cc:161] [id=0] Termination timeout for `all reduce
    RendezvousKey{run_id=..., global_devices=[0, 1, 2, 3], num_local_participants=4,
    collective_op_kind=cross_module, op_id=1}` of 10 seconds exceeded (the script's
    timeout; XLA's own is 40 s). Exiting to
    ensure a consistent program state. Expected 4 threads to join the rendezvous,
    but only 3 of them arrived on time.

Cause (see fleet/runtime/_xla_flags.py): the PjRt CPU client's one thread pool has
max(cores, devices) threads. N-1 threads wait in the all-reduce for the Nth
device's share, while the other pool threads run the next step's per-device
launch, which blocks on the device's limit of 32 in-flight computations. The
Nth share, which would free a slot, has no thread left. The rendezvous timeouts
only turn the hang into an abort. PJRT_NPROC >= 2 x devices avoids it.

Arguments: [steps (2000)] [sync_every (0: never)] [devices (4)]. The script
sets short rendezvous timeouts (5 s + 10 s) so a deadlock aborts in about 15 s
instead of 60 s. Exit code 0: completed; 134 (SIGABRT): the abort above.
"""

import os
import sys
import time

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
sync_every = int(sys.argv[2]) if len(sys.argv) > 2 else 0
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 4
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    f"--xla_force_host_platform_device_count={devices}",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5",  # default 20
    "--xla_cpu_collective_call_terminate_timeout_seconds=10",  # default 40
])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("d",))


def body(w, x):  # a little work per device, then one all-reduce
    return w + jax.lax.psum(jnp.tanh(x @ w).T @ x, "d")


step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
w = jnp.zeros((128, 128))
x = np.ones((8 * devices, 128), np.float32)
start = time.time()
for i in range(1, steps + 1):
    w = step(w, x)  # never waits: dispatch runs ahead of the devices
    if sync_every and i % sync_every == 0:
        w.block_until_ready()
w.block_until_ready()
print(f"completed {steps} steps on {devices} devices in {time.time() - start:.1f} s "
      f"(jax {jax.__version__}, PJRT_NPROC={os.environ.get('PJRT_NPROC')})", flush=True)
