"""Which devices a worker sees: one GPU each (``--gpus``) or N fake CPU devices;
and how many processes this machine can hold (one per GPU, a few per CPU core)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from fleet._errors import FleetConfigError
from fleet.runtime._xla_flags import cpu_collective_environ, keep_remat_barriers

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# CPU processes beyond this many per core only contend for the cores (and memory):
# --allow_oversubscribe lifts the limit.
PROCESSES_PER_CORE = 8


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPU ids this machine lets us use: ``CUDA_VISIBLE_DEVICES`` when it is set,
    else every NVIDIA GPU the driver lists."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(_count_nvidia_gpus())]


def _count_nvidia_gpus() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def check_gpus(selected: Sequence[str], environ: Mapping[str, str]) -> None:
    """Fails when a selected GPU id is not one this machine has."""
    visible = visible_gpus(environ)
    missing = [g for g in selected if g not in visible]
    if missing:
        where = (
            f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
            if "CUDA_VISIBLE_DEVICES" in environ
            else "the NVIDIA driver"
        )
        shown = ",".join(visible) if visible else "none"
        raise FleetConfigError(
            f"--gpus {','.join(selected)}: GPU id(s) {','.join(missing)} do not exist; "
            f"visible GPUs (from {where}): {shown}. Pick ids from that list, or use "
            "--cpu_devices N to run CPU processes with N devices each"
        )
    if len(set(selected)) != len(selected):
        raise FleetConfigError(
            f"--gpus {','.join(selected)} names a GPU twice; each process needs its own GPU"
        )


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_cpu_processes(nproc: int, allow_oversubscribe: bool) -> None:
    """Refuses more than :data:`PROCESSES_PER_CORE` CPU processes per core, before any
    starts, unless ``allow_oversubscribe``."""
    cores = cpu_cores()
    limit = PROCESSES_PER_CORE * cores
    if nproc > limit and not allow_oversubscribe:
        raise FleetConfigError(
            f"--nproc_per_node {nproc} asks for {nproc} CPU processes but this machine has "
            f"{cores} CPU core(s); at most {limit} ({PROCESSES_PER_CORE} per core) start "
            "without --allow_oversubscribe. Use fewer processes (--cpu_devices N gives each "
            "N devices), or pass --allow_oversubscribe (fleet.spawn: "
            "allow_oversubscribe=True) to start them anyway"
        )


def gpu_environ(gpu: str) -> dict[str, str]:
    """The variables that make one process see only ``gpu`` (its device 0), and
    Paddle's ``FLAGS_selected_gpus`` (the physical id) for ported scripts."""
    return {"CUDA_VISIBLE_DEVICES": gpu, "FLAGS_selected_gpus": gpu}


def cpu_environ(count: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that give one process ``count`` CPU devices (and only CPU)."""
    flags = _DEVICE_COUNT_FLAG.sub("", environ.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={count}")
    # jax.checkpoint's recomputation survives XLA:CPU (fleet/runtime/_xla_flags.py).
    env = {"XLA_FLAGS": keep_remat_barriers(" ".join(flags)), "JAX_PLATFORMS": "cpu"}
    # A thread pool large enough for XLA:CPU's collectives (fleet/runtime/_xla_flags.py).
    env.update(cpu_collective_environ(count, environ))
    return env
