"""A program that calls fleet.spawn and blocks in it (for the signal tests).

    spawn_parent.py JOB_ID
"""

import sys

import spawn_targets

from fleet.launch import spawn

if __name__ == "__main__":
    spawn(spawn_targets.sleep_ready, nprocs=2, job_id=sys.argv[1])
