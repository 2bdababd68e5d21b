"""``strategy.check_nan_inf``: the state kept on the device, the result read on
the host without waiting for it.

Inside the step (``fleet.step._program.Program.body``) each call computes one flag per
checked leaf (the outputs, the reduced gradients), agreed over the replicas
(:func:`agreed`: a float output reduced by mean or sum is checked on its sum,
which the body makes, ``fleet.step._program.summed_inside``), and a *chain*, a device
int: 0 while this call and every call before it were
finite, else 1 + the index of the first non-finite leaf of the first
non-finite call (:func:`chain_after`). The state the call writes is
``where(chain == 0, new, old)``: a non-finite call, and every call after it,
leave the parameters, the optimizer state and the buffers bitwise as they
were before the first non-finite call. That select happens on the device, so
the old state can be donated and the host need not wait.

The select itself is made where the optimizer makes the new state, so it costs
no memory: :mod:`fleet.sections._finite_replay`.

On the host, :class:`FiniteFlags` keeps the chains of the calls in flight and
reads one only once it is ready, so a step never waits for the device:

* single process: a call first looks at the earlier calls that have
  finished (no wait) and raises for the first non-finite one, naming the
  leaf and the call (the calls started after it are named too: they ran and
  left the state unchanged). So a non-finite call raises at a later call. A
  look reads one value back from the device, the newest finished call's
  chain (0: every call up to it was finite; else a binary search over the
  calls' chains finds the first non-finite call, and the chain names its
  leaf). A look costs the host about 0.1 ms (the read, and letting go of the
  chains it answers for), so calls do not look at every call: a call looks
  once the calls since the last look took ``1 / LOOK_SHARE`` times as long on
  the host as that look did (looks then take at most ``LOOK_SHARE``, 1%, of
  the host's time in calls, in a loop or in bursts of calls), or once the last
  look is ``LOOK_WITHIN`` (1 s) old. A loop of small steps raises some tens
  of milliseconds after the non-finite call (of the host's time in calls);
  the calls in between run and leave the state unchanged;
* several processes: every process must raise at the same call (the calls are
  collective), so after call ``k+1`` is started, the chain of call ``k`` is
  read, waiting for it: the host runs one step ahead of the device;
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
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleet._errors import FleetError
from fleet.comm._sync import is_varying
from fleet.comm._sync import psum as _psum

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


LOOK_SHARE = 0.01  # looks take at most this share of the host's time in calls
LOOK_WITHIN = 1.0  # seconds: a call looks if the last look is this old (single process)


class FiniteFlags:
    """A step's calls in flight, with their chains (see the module docstring)."""

    def __init__(self) -> None:
        self._chain: tuple[Any, jax.Array] | None = None  # (mesh, device int)
        self._pending: deque = deque()  # (call, names, chain), oldest first
        self._looked = 0.0  # when a call last looked at them (time.perf_counter)
        self._cost = 0.0  # how long the host took for that look
        self._began = 0.0  # when the current call began
        self._in_calls = 0.0  # the host's time in calls since that look

    def due(self) -> bool:
        """Called as a call begins: whether it should look at the chains in flight
        now (there are some, and the calls since the last look took ``1 /
        LOOK_SHARE`` times that look's time, or it is ``LOOK_WITHIN`` old).
        Never with several processes: a look that found a chain back on one
        process and not yet on another would raise there one call earlier,
        and the other process would wait in that call's collectives for it."""
        self._began = now = time.perf_counter()
        return (bool(self._pending) and jax.process_count() == 1
                and (self._in_calls * LOOK_SHARE >= self._cost
                     or now - self._looked >= LOOK_WITHIN))

    def looked(self) -> None:
        """A call's look (``check(wait=False)``) ended: its cost is measured."""
        self._looked = now = time.perf_counter()
        self._cost, self._in_calls = now - self._began, 0.0
        self._began = now  # (the look is not counted as time in calls)

    def chain(self, mesh: Any) -> jax.Array:
        """The chain the next call takes (a replicated device int)."""
        if self._chain is None or (self._chain[0] is not mesh and self._chain[0] != mesh):
            if self._chain is not None:
                self.check(wait=True)  # (a new chain does not tell about these calls)
            self._chain = (mesh, jax.device_put(np.int32(0), NamedSharding(mesh, P())))
        return self._chain[1]

    def record(self, mesh: Any, call: int, names: list[str], chain: jax.Array) -> None:
        """Call ``call`` was started: its checked leaves' names and the chain it leaves."""
        self._in_calls += time.perf_counter() - self._began
        self._chain = (mesh, chain)
        if not self._pending:
            if not _REGISTERED:
                _REGISTERED.append(atexit.register(_report_at_exit))
            _LIVE.add(self)
        self._pending.append((call, names, chain))

    def check(self, *, wait: bool, upto: int | None = None) -> None:
        """Looks at the calls in flight (up to call ``upto``), waiting for them if
        ``wait`` else only at those finished; raises for the first non-finite one.

        One read tells about many calls: the newest call's chain is 0 only if it
        and every call before it were finite. Only when it is not are more
        chains read, a binary search for the first call whose chain is not 0."""
        try:
            self._check(wait, upto)
        finally:
            if not wait:
                self.looked()

    def _check(self, wait: bool, upto: int | None) -> None:
        pending = self._pending
        last = pending[-1][0] if pending else 0
        newest = len(pending) - 1
        while newest >= 0 and upto is not None and pending[newest][0] > upto:
            newest -= 1
        if not wait and newest >= 0 and not pending[newest][2].is_ready():
            # The newest finished call: calls finish in order (the chain of one is
            # the next's input), so a binary search over them asks few.
            ready, running = -1, newest  # pending[ready] finished, pending[running] not
            while running - ready > 1:
                middle = (ready + running) // 2
                if pending[middle][2].is_ready():
                    ready = middle
                else:
                    running = middle
            newest = ready
        if newest < 0:
            return
        bad = _read(pending[newest][2])
        if not bad:
            for _ in range(newest + 1):
                pending.popleft()
            return
        first, end = 0, newest  # the first non-finite call is in first..end
        while first < end:
            middle = (first + end) // 2
            if _read(pending[middle][2]):
                end = middle
            else:
                first = middle + 1
        call, names, _ = pending[first]
        pending.clear()
        self._chain = None
        raise FleetError(_message(names[bad - 1], call, last))


def _read(chain: jax.Array) -> int:
    return int(np.asarray(chain.addressable_data(0)))


def agreed(flags: list) -> list:
    """A call's flags (inside the step), each true on every replica or on none.
    Those that may differ across replicas (a per-example or 16-bit output's, a
    local gradient's) are summed over them in one psum; the others (reduced
    gradients, summed outputs) are the same everywhere already. The psum then
    reads the outputs only, not the gradient reduction, so XLA can merge it with
    a gradient bucket's all-reduce instead of adding one to the step (it still
    adds an array to that all-reduce)."""
    flags = list(flags)
    varying = [i for i, f in enumerate(flags) if is_varying(f)]
    if varying:
        # (float32, as the gradients: XLA merges only all-reduces of one reduction)
        bad = _psum([(~jnp.stack([flags[i] for i in varying])).astype(jnp.float32)])[0]
        for k, i in enumerate(varying):
            flags[i] = bad[k] == 0
    return flags


def chain_after(flags: Sequence, chain_in: jax.Array) -> jax.Array:
    """The chain a call leaves (inside the step): the one it took if that is not
    0, else 0 if every agreed flag of this call holds, else 1 + the index of its
    first non-finite leaf.

    Each flag is read once, by a select (not stacked and reduced twice, for
    ``all`` and ``argmin``): XLA then fuses the leaves' finiteness reductions
    into the chain's computation, as it does ``optax.apply_if_finite``'s check
    (XLA:CPU up to six of them), instead of one program step per leaf."""
    bad = jnp.int32(0)
    for i in reversed(range(len(flags))):  # (the first non-finite leaf is the last select)
        bad = jnp.where(flags[i], bad, jnp.int32(i + 1))
    return jnp.where(chain_in > 0, chain_in, bad).astype(jnp.int32)


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
