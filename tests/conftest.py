"""Test set-up: 8 fake CPU devices, set before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    # strategy.recompute's barriers survive XLA:CPU (fleet/_xla_flags.py)
    + " --xla_disable_hlo_passes=cse_barrier_expander"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["PJRT_NPROC"] = str(max(16, os.cpu_count() or 1))  # 2 x 8 devices: fleet/_xla_flags.py

import jax  # noqa: E402
import pytest  # noqa: E402

assert len(jax.devices()) == 8, "conftest must run before jax is imported"


@pytest.fixture
def world():
    """A fresh fleet world over all 8 devices (strategy defaults)."""
    import fleet
    from fleet import _world

    _world._WORLD = None
    yield fleet.init(is_collective=True)
    _world._WORLD = None


@pytest.fixture
def make_world():
    """``make_world(n, strategy=None)``: a fresh fleet world over the first n devices."""
    import fleet
    from fleet import _world

    def make(n: int, strategy=None):
        _world._WORLD = None
        return fleet.init(is_collective=True, strategy=strategy, devices=jax.devices()[:n])

    yield make
    _world._WORLD = None
