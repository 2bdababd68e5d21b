"""Bounded agreement between processes: ``agree(name, value)``.

Every fleet call that needs all processes (a sampler starting an epoch, a step
compiling its program, a checkpoint manager opening its directory) goes through
:func:`agree`: each process publishes a short string under ``name`` in JAX's
distributed key-value store and reads every other process's string. It never
waits forever: after ``timeout_s`` seconds it raises
:class:`FleetTimeoutError`, naming the call and the ranks that did not join.
A process that never makes the call (``if fleet.is_first_worker(): ...``) thus
ends its peers with a message, instead of leaving them blocked.

Keys are ``fleet/agree/<name>/<n>/<rank>``, where ``n`` counts this process's
calls under ``name``: processes that make the same calls in the same order meet
under the same keys. With one process, ``agree`` returns ``[value]`` at once.
"""

from __future__ import annotations

import os
import time

import jax

from fleet import _compat
from fleet._errors import FleetError
from fleet.runtime._env import number

#: Default bound on every wait, in seconds; ``FLEET_AGREE_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 60.0

_calls: dict[str, int] = {}
_raised: list[str] = []  # the calls whose disagreement every process raises (raise_together)


class FleetTimeoutError(FleetError, TimeoutError):
    """A call that needs every process was not joined by all of them in time."""


def default_timeout() -> float:
    return number(os.environ, "FLEET_AGREE_TIMEOUT", DEFAULT_TIMEOUT_S, parse=float,
                  what="a number of seconds")


def agree(name: str, value: str, *, timeout_s: float | None = None) -> list[str]:
    """Publishes ``value`` and returns every process's value, in rank order.

    Every process must call it with the same ``name`` (and in the same order
    relative to its other ``agree`` calls). It waits at most ``timeout_s``
    seconds (default :data:`DEFAULT_TIMEOUT_S`, or ``FLEET_AGREE_TIMEOUT``).

    Raises:
        FleetTimeoutError: some processes did not make this call in time; the
            message names the call and those ranks.

    Example:
        >>> agree("dataset-length", "60000")  # one process: its own value
        ['60000']
    """
    nproc, rank = jax.process_count(), jax.process_index()
    if nproc == 1:
        return [value]
    client = _compat.distributed_client()
    if client is None:  # several processes but no runtime: nothing to agree through
        return [value]
    timeout_s = default_timeout() if timeout_s is None else timeout_s
    n = _calls.get(name, 0)
    _calls[name] = n + 1
    prefix = f"fleet/agree/{name}/{n}/"
    client.key_value_set(prefix + str(rank), value)
    deadline = time.monotonic() + timeout_s
    values: list[str | None] = [None] * nproc
    values[rank] = value
    for other in range(nproc):
        if values[other] is not None:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            values[other] = client.blocking_key_value_get(prefix + str(other), left_ms)
        except Exception as e:  # noqa: BLE001 (jaxlib raises its own runtime error)
            timed_out = time.monotonic() >= deadline - 0.05  # the wait ran its course
            try:
                present = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(prefix)}
                missing = [r for r in range(nproc) if str(r) not in present]
            except Exception:  # noqa: BLE001 (the coordinator itself is gone)
                missing = [other]
            why = (f"waited {timeout_s:g} s for every process to make this call, but"
                   if timed_out else f"lost the job's key-value store ({str(e).splitlines()[0]}):")
            raise FleetTimeoutError(
                f"{name}: process {rank} {why} rank(s) {missing} did not make it; every "
                "process must make this call (do not guard it with `if "
                "fleet.is_first_worker():`). Set FLEET_AGREE_TIMEOUT to wait longer"
            ) from None
    return values  # type: ignore[return-value]


def join(name: str, *, timeout_s: float | None = None) -> None:
    """Waits (bounded) until every process reaches the collective call ``name``;
    put it before a JAX collective that would otherwise wait forever for a rank
    that never makes the call."""
    agree(name, "", timeout_s=timeout_s)


def _all_arrived(prefix: str, timeout_s: float) -> None:
    """Each process sets its key under ``prefix``; process 0 returns once every
    other process has (or after ``timeout_s``). Best effort: never raises."""
    client, rank = _compat.distributed_client(), jax.process_index()
    try:
        client.key_value_set(prefix + str(rank), "1")
        if rank == 0:
            deadline = time.monotonic() + timeout_s
            for other in range(1, jax.process_count()):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                client.blocking_key_value_get(prefix + str(other), left_ms)
    except Exception:  # noqa: BLE001 (the caller raises or exits either way)
        pass


def raise_together(name: str, *, timeout_s: float = 10.0) -> None:
    """Before every process raises the same error, after ``agree(name, ...)``
    showed a disagreement: process 0, whose exit takes JAX's key-value service
    down with it, returns once every other process has called this (or after
    ``timeout_s``), so that each raises its own error instead of dying in a read
    when the service goes away. Never raises."""
    if _compat.distributed_client() is None or jax.process_count() == 1:
        return
    _raised.append(name)
    _all_arrived(f"fleet/agree/{name}/raising/", timeout_s)


def exit_together(*, timeout_s: float = 10.0) -> None:
    """At a failing process's exit, after :func:`raise_together`: each process
    says it has printed its error, and process 0 exits once every other has (or
    after ``timeout_s``). Its exit ends the job's key-value service, and JAX then
    aborts the others from a background thread: without this wait, a process
    still printing its own error died mid-way, its log holding only JAX's abort.
    Nothing to do when no disagreement was raised together. Never raises."""
    if _raised and _compat.distributed_client() is not None:
        _all_arrived(f"fleet/agree/{_raised[-1]}/exited/", timeout_s)
