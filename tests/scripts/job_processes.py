"""Finds the processes of a job by the FLEET_JOB_ID in their environment (tests only)."""

import time

import psutil


def job_processes(job_id):
    """Every live (non-zombie) process on this machine whose FLEET_JOB_ID is ``job_id``."""
    found = []
    for p in psutil.process_iter():
        try:
            if (p.status() != psutil.STATUS_ZOMBIE
                    and p.environ().get("FLEET_JOB_ID") == job_id
                    and "resource_tracker" not in " ".join(p.cmdline())):
                found.append(p)  # (multiprocessing's resource tracker lives on by design)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def wait_until_gone(job_id, timeout=5.0):
    """The job's processes left after ``timeout`` seconds (init reaps orphans)."""
    deadline = time.monotonic() + timeout
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
