"""XLA:CPU collectives on several CPU devices in one process: the thread-pool
deadlock that aborts with "Termination timeout for `all reduce ...` ... only 3 of
them arrived", and the environment fleet sets against it (fleet/runtime/_xla_flags.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fleet.runtime import _xla_flags
from fleet.runtime._xla_flags import cpu_collective_environ, cpu_device_count

REPRO = Path(__file__).resolve().parents[1] / "benchmarks" / "xla_cpu_allreduce_deadlock.py"


def test_device_count_from_the_environment():
    assert cpu_device_count({}) == 1
    flags = "--xla_force_host_platform_device_count=2 --xla_force_host_platform_device_count=4"
    assert cpu_device_count({"XLA_FLAGS": flags}) == 4  # XLA takes the last one
    assert cpu_device_count({"XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "3"}) == 3


def test_pool_of_twice_the_devices(monkeypatch):
    monkeypatch.setattr(_xla_flags, "_cores", lambda: 2)
    assert cpu_collective_environ(4, {}) == {"PJRT_NPROC": "8"}
    assert cpu_collective_environ(8, {"PJRT_NPROC": "3"}) == {"PJRT_NPROC": "16"}
    assert cpu_collective_environ(4, {"PJRT_NPROC": "32"}) == {}  # only ever raised
    assert cpu_collective_environ(1, {}) == {}  # one device: no in-process collectives
    monkeypatch.setattr(_xla_flags, "_cores", lambda: 64)
    assert cpu_collective_environ(4, {}) == {"PJRT_NPROC": "64"}  # never below the cores


def test_run_ahead_all_reduce_loop_completes_with_fleets_environment():
    """2000 all-reduce steps dispatched without waiting, on 4 CPU devices. Without
    PJRT_NPROC (a 2-core machine: a pool of 4 threads) this deadlocks and aborts."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(cpu_collective_environ(4, env))
    run = subprocess.run([sys.executable, str(REPRO), "2000", "0", "4"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "completed 2000 steps" in run.stdout


def test_remat_barriers_are_kept_on_cpu_and_other_disabled_passes_stay():
    keep = _xla_flags.keep_remat_barriers
    assert keep("") == "--xla_disable_hlo_passes=cse_barrier_expander"
    assert keep("--xla_foo=1 --xla_disable_hlo_passes=a,b") == (
        "--xla_foo=1 --xla_disable_hlo_passes=a,b,cse_barrier_expander")
    flags = "--xla_disable_hlo_passes=cse_barrier_expander --xla_foo=1"
    assert keep(flags) == flags
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_foo=1"}
    assert _xla_flags.apply_cpu_collective_environ(env)
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_disable_hlo_passes=cse_barrier_expander"
    env = {"XLA_FLAGS": "--xla_foo=1"}  # a GPU may be there: leave XLA alone
    _xla_flags.apply_cpu_collective_environ(env)
    assert env["XLA_FLAGS"] == "--xla_foo=1"
