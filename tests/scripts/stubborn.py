"""A plain worker that ignores SIGTERM and leaves a child in its process group."""

import os
import signal
import subprocess
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "60"])
print(f"rank {os.environ['FLEET_RANK']} pid {os.getpid()} child {child.pid} ready", flush=True)
time.sleep(60)
