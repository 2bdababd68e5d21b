"""Fail fast: a worker that fails leaves at once instead of waiting for its peers.

At interpreter exit JAX's distributed client waits in a shutdown barrier for
every other process. A worker that raised, or called ``sys.exit(non-zero)``,
while its peers wait for it inside a collective would wait there for them, and
they for it: the launcher would never see it fail. ``fleet.init`` therefore
calls :func:`install` in a multi-process job; when the program ends with an
uncaught exception (already printed by then) or a non-zero ``sys.exit`` from the
main thread, the process flushes its output and ends with ``os._exit(code)``
before that barrier. A successful exit still shuts down cleanly. (A bare
``raise SystemExit(n)`` is not seen; JAX's own shutdown timeout ends it.)
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

_state: dict[str, object] = {}


def _exit(status: object = None) -> None:
    if threading.current_thread() is threading.main_thread():
        _state["status"] = status
    _state["real_exit"](status)


def _code(status: object) -> int:
    if status is None:
        return 0
    if isinstance(status, bool) or not isinstance(status, int):
        return 1  # sys.exit("message") prints the message and exits 1
    return status & 0xFF


def _at_exit() -> None:
    code = _code(_state.get("status"))
    last = getattr(sys, "last_value", None)  # set when an uncaught exception was printed
    if not code and last is not None and not isinstance(last, (SystemExit, KeyboardInterrupt)):
        code = 1
    if isinstance(last, KeyboardInterrupt):
        code = 130
    if code:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed stream)
                pass
        os._exit(code)


def install() -> None:
    """Makes a failing worker exit at once (see the module docstring). Idempotent."""
    if "real_exit" in _state:
        return
    _state["real_exit"] = sys.exit
    sys.exit = _exit
    atexit.register(_at_exit)  # atexit runs last-in first-out: before JAX's own clean-up
