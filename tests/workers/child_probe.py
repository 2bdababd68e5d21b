"""What a child of a job's worker does with fleet: ``import fleet``, then
``fleet.init(is_collective=True)``. Writes whether it joined the job to a JSON
file (``tests/test_two_processes.py``, scenario ``children``).

    python child_probe.py OUT.json      # a subprocess child
    child_probe.main(OUT)               # a multiprocessing child
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

import fleet  # noqa: E402


def main(out: str) -> None:
    seen = {"pid": os.getpid(), "parent": os.getppid(),
            "joined_at_import": jax.distributed.is_initialized()}
    try:
        fleet.init(is_collective=True)
        seen["init"] = "no error"
    except fleet.FleetConfigError as e:
        seen["init"] = str(e)
    seen["joined"] = jax.distributed.is_initialized()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1])
