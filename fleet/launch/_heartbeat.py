"""The worker side of the liveness signal: ``heartbeat()``.

The launcher gives every worker a file, ``FLEET_HEARTBEAT_FILE``; calling
:func:`heartbeat` touches it (one ``utime`` system call, a few microseconds).
``fleet.distributed_step`` calls it when a step starts and when it returns; a
script with its own loop can call it too. Once a worker has sent one heartbeat,
the launcher's watchdog expects the next within ``--progress_timeout`` seconds,
so a worker that deadlocks, or waits forever on a dead peer, ends the job
instead of hanging it. Beating at the start of a step is what lets the watchdog
tell the worker that is behind (it never started the step its peers wait in)
from the peers. Outside a launcher it does nothing.
"""

from __future__ import annotations

import os


def heartbeat() -> None:
    """Tells the launcher this worker is making progress (cheap; call it every step).

    Example:
        >>> from fleet.launch import heartbeat
        >>> for step in range(3):
        ...     heartbeat()   # no-op when not started by fleetrun / fleet.spawn
    """
    path = os.environ.get("FLEET_HEARTBEAT_FILE")
    if not path:
        return
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            with open(path, "a"):
                pass
        except OSError:
            pass
    except OSError:
        pass
