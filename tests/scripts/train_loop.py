"""A fleetrun worker that trains LinearNet step after step (real collectives), for
the failure tests: it can hang (a simulated deadlock) or raise on one rank.

    train_loop.py [--steps N] [--hang_rank R --hang_step S] [--raise_rank R --raise_step S]
                  [--exit HOW] [--no_heartbeat] [--extra_step_rank R]
                  [--stop_rank R --stop_step S]

``--exit HOW``: how rank ``--raise_rank`` fails at ``--raise_step``: ``raise`` (a
ValueError, the default), ``sys.exit`` (``sys.exit(3)``) or ``SystemExit``
(``raise SystemExit(4)``).

``--extra_step_rank R``: rank R runs one step more than the others (uneven data).

``--stop_rank R --stop_step S``: rank R stops itself (``SIGSTOP``, as a stuck
filesystem or a debugger would) before step S.
"""

import argparse
import os
import signal
import sys
import time

from linear_common import GLOBAL_BATCH, _model, global_batch

import fleet
from fleet.launch import heartbeat

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--hang_rank", type=int, default=-1)
parser.add_argument("--hang_step", type=int, default=-1)
parser.add_argument("--raise_rank", type=int, default=-1)
parser.add_argument("--raise_step", type=int, default=-1)
parser.add_argument("--exit", default="raise", choices=["raise", "sys.exit", "SystemExit"])
parser.add_argument("--extra_step_rank", type=int, default=-1)
parser.add_argument("--stop_rank", type=int, default=-1)
parser.add_argument("--stop_step", type=int, default=-1)
parser.add_argument("--no_heartbeat", action="store_true",
                    help="rely on distributed_step's own heartbeats")
args = parser.parse_args()

import optax  # noqa: E402
from flax import nnx  # noqa: E402

fleet.init(is_collective=True)
rank, count = fleet.worker_index(), fleet.worker_num()
print(f"pid {os.getpid()} rank {rank} of {count}", flush=True)
model = fleet.distributed_model(_model())
optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))


@fleet.distributed_step
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


rows = GLOBAL_BATCH // count
for step in range(args.steps + (rank == args.extra_step_rank)):
    if rank == args.hang_rank and step == args.hang_step:
        print(f"rank {rank} hangs at step {step}", flush=True)
        while True:
            time.sleep(1)
    if rank == args.stop_rank and step == args.stop_step:
        print(f"rank {rank} stops itself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == args.raise_rank and step == args.raise_step:
        print(f"rank {rank} fails at step {step} ({args.exit})", flush=True)
        if args.exit == "sys.exit":
            sys.exit(3)
        if args.exit == "SystemExit":
            raise SystemExit(4)
        raise ValueError(f"boom from rank {rank} at step {step}")
    if not args.no_heartbeat:
        heartbeat()
    x, y = global_batch(step)
    loss = float(train_step(model, optimizer, x[rank * rows:(rank + 1) * rows],
                            y[rank * rows:(rank + 1) * rows]))
    if not args.no_heartbeat:
        heartbeat()
    print(f"step:{step}\tloss:{loss:.6f}", flush=True)
    time.sleep(0.02)
print(f"rank {rank} ran {step + 1} steps", flush=True)
if rank == args.hang_rank and args.hang_step == args.steps:  # after the last step
    print(f"rank {rank} hangs after its last step", flush=True)
    while True:
        time.sleep(1)
