"""The quick-start scripts run as the README says and print the same losses."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, devices: int) -> list[float]:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "examples/quickstart" / script)],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"devices: {devices}" in out
    return [float(v) for v in re.findall(r"loss:([-\d.]+)", out)]


def test_quickstart_fleet_on_4_devices_matches_single_card():
    single, distributed = run("train_single.py", 1), run("train_fleet.py", 4)
    assert len(single) == len(distributed) == 20
    assert max(abs(a - b) for a, b in zip(single, distributed)) < 1e-5
