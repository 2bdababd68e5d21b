"""Functions for fleet.spawn tests (spawned children import this module by name)."""

import os
import signal
import sys
import time


def train():
    from linear_common import train_fleet

    return train_fleet()


def describe(tag):
    import fleet

    fleet.init(is_collective=True)
    return {"tag": tag, "rank": fleet.worker_index(), "count": fleet.worker_num(),
            "devices": len(fleet.world().local_devices),
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("FLEET_", "PADDLE_", "JAX_PLATFORMS"))}}


def rank():
    return int(os.environ["FLEET_RANK"])


def fail_on_rank_1(how):
    """Rank 0 waits (to be stopped by the parent); rank 1 fails in the way asked."""
    if rank() == 0:
        print(f"pid {os.getpid()}", flush=True)
        time.sleep(60)
        return "rank 0 was not stopped"
    if how == "raise":
        raise ValueError("boom from spawned rank 1")
    if how == "exit":
        sys.exit(5)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == "unpicklable":
        return lambda: None
    return "nothing"


def sleep_ready():
    print(f"rank {rank()} ready", flush=True)
    time.sleep(60)


def key_error_after_init():
    """Both ranks join the job (fleet.init); rank 1 raises a KeyError, rank 0 waits."""
    import fleet

    fleet.init(is_collective=True)
    if rank() == 1:
        raise KeyError("boom in rank 1")
    time.sleep(60)
