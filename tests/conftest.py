"""Test set-up: 8 fake CPU devices, set before anything imports jax, and JAX's
persistent compilation cache, shared with every process the tests start."""

import os
import signal
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    # strategy.recompute's barriers survive XLA:CPU (fleet/runtime/_xla_flags.py)
    + " --xla_disable_hlo_passes=cse_barrier_expander"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["PJRT_NPROC"] = str(max(16, os.cpu_count() or 1))  # 2 x 8 devices: fleet/runtime/_xla_flags.py

# The same programs compile in many tests and in every launched worker: JAX keeps
# them in one directory of the checkout (ignored by git), so a worker loads what
# another process compiled, and a second run of the suite compiles little. The
# variables reach the workers through their inherited environment.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import tiers  # noqa: E402
from tests.jobs import jobs  # noqa: E402,F401 (a fixture: starts fleetrun jobs)

# pytest imports fleet, and with it jax, before this file (to resolve the
# filterwarnings entry in pyproject.toml): JAX had read its settings from the
# environment by then. The variables above reach the workers; this process takes
# them here. (XLA_FLAGS is read later, when the first device is asked for.)
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

assert len(jax.devices()) == 8, "conftest must set XLA_FLAGS before jax's first device"


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, and one more for the default tier, at most 4
    (each holds 8 fake devices and starts jobs of its own). The default tier's
    workers wait for the jobs they start (cold on 2 cores: 348 s with 2 workers,
    332 s with 3); the slow tier keeps one a core, since its watchdog tests time
    waits of seconds."""
    cores = os.cpu_count() or 1
    slow_tier = "slow" in (config.getoption("markexpr", "") or "").replace("not slow", "")
    return max(1, min(cores if slow_tier or cores == 1 else cores + 1, 4))


@pytest.hookimpl(tryfirst=True)  # (before -m deselects by the marks)
def pytest_collection_modifyitems(config, items):
    tiers.mark_costly(items, config.args)


def pytest_runtest_setup(item):
    tiers.check_costly(item)


@pytest.fixture
def sigint_default():
    """Ctrl-C raises KeyboardInterrupt during the test, as in a foreground terminal.

    A shell starts background jobs (``nohup pytest ... &``, some CI runners) with
    SIGINT ignored, and Python then installs no handler of its own: a test that
    sends SIGINT would see nothing happen. The processes the test starts inherit
    the default action (a handler is reset at exec), so they behave alike."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def world():
    """A fresh fleet world over all 8 devices (strategy defaults)."""
    import fleet
    from fleet.runtime import _world

    _world._WORLD = None
    yield fleet.init(is_collective=True)
    _world._WORLD = None


@pytest.fixture
def make_world():
    """``make_world(n, strategy=None)``: a fresh fleet world over the first n devices."""
    import fleet
    from fleet.runtime import _world

    def make(n: int, strategy=None):
        _world._WORLD = None
        return fleet.init(is_collective=True, strategy=strategy, devices=jax.devices()[:n])

    yield make
    _world._WORLD = None
