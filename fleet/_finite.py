"""``strategy.check_nan_inf`` on the host, without waiting for the device.

Inside the step (``fleet._body.Program.run``) each call computes one flag per
checked leaf (the outputs, the reduced gradients), agreed over the replicas,
and a *chain* flag: true while this call and every call before it were
finite. The state the call writes is ``where(chain, new, old)``: a non-finite
call, and every call after it, leave the parameters, the optimizer state and
the buffers bitwise as they were before the first non-finite call. That select
happens on the device, so the old state can be donated and the host need not
wait.

On the host, :class:`FiniteFlags` keeps the flag vectors of the calls in
flight and reads one only once it is ready, so a step never waits for the
device:

* single process: each call first reads the flags of the earlier calls that
  have finished (no wait) and raises for the first non-finite one, naming the
  leaf and the call (the calls started after it are named too: they ran and
  left the state unchanged). So a non-finite call raises at a later call;
* several processes: every process must raise at the same call (the calls are
  collective), so after call ``k+1`` is started, the flags of call ``k`` are
  read, waiting for them: the host runs one step ahead of the device;
* :meth:`FiniteFlags.check` with ``wait=True`` (``DistributedStep.wait()``,
  and with each ``check_replicas_every_n_steps`` check) waits for every call in
  flight and raises for a non-finite one.

After the error is raised the chain starts again: the next call trains.

A non-finite call still unread when the interpreter exits (the loop ended
without ``step.wait()``) is reported on stderr then, so a skipped step is never
silent.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections import deque
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet._errors import FleetError

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the FiniteFlags with calls in flight
_REGISTERED: list = []  # the exit report, registered at the first call


def _report_at_exit() -> None:
    """Reads every call still in flight; a non-finite one is said on stderr."""
    for flags in list(_LIVE):
        try:
            flags.check(wait=True)
        except FleetError as e:
            print(f"fleet: {e} (found at exit: call step.wait() after the last step to "
                  "raise it in the loop)", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 (the runtime may be gone: nothing more to say)
            pass


class FiniteFlags:
    """A step's flags in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._chain: tuple[Any, jax.Array] | None = None  # (mesh, device bool)
        self._pending: deque = deque()  # (call, flags, names), oldest first

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def chain(self, mesh: Any) -> jax.Array:
        """The chain flag the next call takes (a replicated device bool)."""
        if self._chain is None or self._chain[0] != mesh:
            self._chain = (mesh, jax.device_put(np.True_, NamedSharding(mesh, P())))
        return self._chain[1]

    def record(self, mesh: Any, call: int, flags: jax.Array, names: list[str],
               chain: jax.Array) -> None:
        """Call ``call`` was started: its per-leaf flags and the chain it leaves."""
        self._chain = (mesh, chain)
        self._pending.append((call, flags, names))
        if not _REGISTERED:
            _REGISTERED.append(atexit.register(_report_at_exit))
        _LIVE.add(self)

    def check(self, *, wait: bool, upto: int | None = None) -> None:
        """Reads the flags of the calls in flight, oldest first (up to call
        ``upto``), waiting for them if ``wait`` else only those finished; raises
        for the first non-finite one."""
        last = self._pending[-1][0] if self._pending else 0
        while self._pending:
            call, flags, names = self._pending[0]
            if (upto is not None and call > upto) or (not wait and not flags.is_ready()):
                return
            self._pending.popleft()
            values = np.asarray(flags.addressable_data(0))
            bad = next((n for n, ok in zip(names, values) if not ok), None)
            if bad is not None:
                self._pending.clear()
                self._chain = None
                raise FleetError(_message(bad, call, last))


def _message(name: str, call: int, last: int) -> str:
    later = ""
    if last > call:
        later = (f" (the calls started since, {call + 1}.."
                 f"{last}, ran and left it unchanged too)" if last > call + 1 else
                 f" (call {last}, started since, ran and left it unchanged too)")
    return (
        f"check_nan_inf: {name} holds NaN or infinity after call {call} of the step; "
        f"the state was left as it was before this call{later}. Look for a bad batch, "
        "a too-large learning rate, or a log/division of zero"
    )
