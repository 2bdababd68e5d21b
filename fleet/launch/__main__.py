"""``python -m fleet.launch``: the same program as ``fleetrun``."""

import sys

from fleet.launch import main

if __name__ == "__main__":
    sys.exit(main())
