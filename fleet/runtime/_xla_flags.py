"""XLA:CPU settings for collectives over several CPU devices in one process.

The problem (jax / jaxlib 0.10.2)
---------------------------------
With N CPU devices in one process (``--xla_force_host_platform_device_count=N``
or ``jax_num_cpu_devices``), a training loop that dispatches steps faster than
they run can abort after a minute with::

    Termination timeout for `all reduce RendezvousKey{...}` of 40 seconds
    exceeded. Exiting to ensure a consistent program state. Expected 4 threads
    to join the rendezvous, but only 3 of them arrived on time.

It is a deadlock, not a slow thread: the process sits at 0% CPU, and raising
``--xla_cpu_collective_call_terminate_timeout_seconds`` only turns the abort
into a hang. XLA's CPU client runs everything on one thread pool of
``max(PJRT_NPROC or the number of cores, N)`` threads, so N on a machine with
fewer cores than devices (2 cores, 4 devices: 4 threads):

* each device's share of a multi-device program holds a pool thread for its
  whole run, and waits inside the all-reduce until all N shares have arrived;
* each device accepts at most 32 computations in flight. The per-device launch
  of the next program waits for a free slot *on a pool thread*.

Once the Python loop is about 32 steps ahead of the devices, up to N launch
tasks wait for slots, N-1 shares of the oldest step wait in the all-reduce, and
the last share of that step, which would free the slots, has no thread to run
on. ``gdb`` on a stuck process shows exactly that: 3 pool threads in
``InProcessCommunicator::AllReduce``, the 4th in ``Semaphore::ScopedAcquire``.

The fix
-------
A pool of at least ``2 * N`` threads always leaves one thread free (at most N-1
waiting in the all-reduce plus N waiting to launch). The bound is sharp: on 2
cores, 2000 un-waited steps of ``benchmarks/xla_cpu_allreduce_deadlock.py``
abort with pools of 7 (4 devices) and 15 (8 devices) threads, and complete with
8 and 16 (20 of 20 runs with 8).

``PJRT_NPROC`` sets the pool size (``xla/pjrt/utils.cc``,
``DefaultThreadPoolSize``: read when the CPU client is created, at the first JAX
computation; the number of cores by default). It also sizes XLA's intra-op
pool, so on a small machine that pool gets more threads than cores.

No XLA flag or JAX option helps. The rendezvous timeouts
(``--xla_cpu_collective_call_warn_stuck_timeout_seconds``, default 20, and
``--xla_cpu_collective_call_terminate_timeout_seconds``, default 40; the abort
comes after both, 60 s) only decide how long the deadlock lasts;
``jax_cpu_enable_async_dispatch=False`` still deadlocks (measured); the limit of
32 in-flight computations per device is not exposed by JAX.

So fleet sets ``PJRT_NPROC`` to ``max(2 * N, cores, any larger value already
set)`` wherever it sets up CPU devices, before JAX creates its CPU client.

Recomputation on XLA:CPU
------------------------
``jax.checkpoint`` (``strategy.recompute``) puts an optimization barrier in
front of the recomputed forward so that XLA does not merge it back into the
first forward. XLA:CPU expands barriers early (its ``cse_barrier_expander``
pass) and CSE then undoes the recomputation: the compiled step keeps every
activation (measured: temp bytes of a 6-block MLP equal with and without
``jax.checkpoint``; 20.4 MB against 7.9 MB with the pass off, gradients
bitwise equal). Where JAX runs on CPU only (``JAX_PLATFORMS=cpu``: fleet's
launcher, the tests), fleet adds ``--xla_disable_hlo_passes=cse_barrier_expander``
to ``XLA_FLAGS``. GPU and TPU keep the barrier by themselves.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, MutableMapping

POOL_VARIABLE = "PJRT_NPROC"
KEEP_BARRIERS = "cse_barrier_expander"
_DISABLED_PASSES = re.compile(r"--xla_disable_hlo_passes=(\S*)")
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def keep_remat_barriers(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with XLA:CPU's barrier expander off
    (see the module docstring); other disabled passes are kept."""
    found = _DISABLED_PASSES.findall(flags)
    passes = [p for p in (found[-1].split(",") if found else []) if p]
    if KEEP_BARRIERS in passes:
        return flags
    rest = _DISABLED_PASSES.sub("", flags).split()
    return " ".join(rest + ["--xla_disable_hlo_passes=" + ",".join(passes + [KEEP_BARRIERS])])


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_device_count(environ: Mapping[str, str] | None = None) -> int:
    """How many CPU devices JAX will create in this process, as far as the environment
    (and an already imported ``jax.config``) says; 1 when nothing asks for more."""
    environ = os.environ if environ is None else environ
    count = 1
    found = _DEVICE_COUNT.findall(environ.get("XLA_FLAGS", ""))
    if found:
        count = int(found[-1])  # XLA takes the last one
    configured = environ.get("JAX_NUM_CPU_DEVICES")
    if environ is os.environ and "jax" in sys.modules:  # this process: ask jax.config
        try:
            configured = sys.modules["jax"].config.jax_num_cpu_devices
        except AttributeError:
            pass
    try:
        if configured is not None and int(configured) >= 0:
            count = int(configured)  # jax_num_cpu_devices wins over the XLA flag
    except ValueError:
        pass
    return max(count, 1)


def cpu_collective_environ(num_devices: int | None = None,
                           environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a process with ``num_devices`` CPU devices needs so that its
    collectives cannot deadlock (see the module docstring): ``{"PJRT_NPROC": ...}``,
    or ``{}`` when the process has one device or the pool is already large enough.

    ``num_devices`` defaults to :func:`cpu_device_count` of ``environ``
    (``os.environ`` by default). A ``PJRT_NPROC`` already set is only ever raised.
    """
    environ = os.environ if environ is None else environ
    n = cpu_device_count(environ) if num_devices is None else int(num_devices)
    if n <= 1:
        return {}
    try:
        current = int(environ.get(POOL_VARIABLE, ""))
    except ValueError:
        current = 0
    wanted = max(2 * n, _cores())
    if current >= wanted:
        return {}
    return {POOL_VARIABLE: str(wanted)}


def apply_cpu_collective_environ(environ: MutableMapping[str, str] | None = None, *,
                                 started: Callable[[], bool] = lambda: False) -> bool:
    """Sets :func:`cpu_collective_environ` in ``environ`` (``os.environ``) unless
    ``started()`` says JAX has created its backends, and where JAX runs on CPU only
    (``JAX_PLATFORMS=cpu``) :func:`keep_remat_barriers` in its ``XLA_FLAGS``; returns
    whether it changed anything.

    Call it before the first JAX computation (``import fleet`` does). Once the CPU
    client exists its pool size is fixed, and this does nothing. This module
    imports nothing that imports JAX: the caller that may run after JAX passes
    ``started`` (``fleet._compat.backends_are_initialized``).
    """
    environ = os.environ if environ is None else environ
    wanted = cpu_collective_environ(None, environ)
    if environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        flags = keep_remat_barriers(environ.get("XLA_FLAGS", ""))
        if flags != environ.get("XLA_FLAGS", ""):
            wanted["XLA_FLAGS"] = flags
    if not wanted:
        return False
    if environ is os.environ and started():
        return False
    environ.update(wanted)
    return True
