"""How fleetrun runs a training script in each worker: ``python -u _run.py SCRIPT ARGS``.

It runs ``SCRIPT`` as ``python SCRIPT ARGS`` would (``runpy.run_path`` as
``__main__``, with the script's ``sys.argv`` and its directory first on
``sys.path``), and sees how the script ends, without replacing ``sys.exit`` or
any other part of the interpreter:

* an exception escapes the script: it is printed as Python prints it (through
  ``sys.excepthook``; the traceback starts at the script, the runner's frames
  left out), and the worker exits 1; a ``KeyboardInterrupt`` ends it as it
  ends Python;
* ``sys.exit(status)`` or ``raise SystemExit(status)``: the worker exits with
  that status (a message is printed, as Python does);
* the script ends: the worker ends normally.

A failing worker of a multi-process job must not wait in JAX's shutdown barrier
for peers that are waiting for it inside a collective (the launcher would never
see it fail). So the status goes to :func:`fleet.runtime._worker.note_exit`, whose exit
hook (registered when the worker joined the job, so it runs before JAX's own)
ends a failing worker with ``os._exit`` once Python's clean-up before exit has
run (a pending checkpoint save is still awaited). A successful worker shuts
down normally.

This file is run by its path and imports nothing from fleet itself: whatever
the script does before ``import fleet`` (setting ``XLA_FLAGS``, say) still
comes first.
"""

from __future__ import annotations

import os
import runpy
import sys


def _note(status: object) -> None:
    worker = sys.modules.get("fleet.runtime._worker")  # only if the script imported fleet
    if worker is not None:
        worker.note_exit(status)


def _from_script(tb, script: str):
    """The traceback from the script's first frame on (the runner's left out)."""
    start = tb
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == script:
            return tb
        tb = tb.tb_next
    return start


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: _run.py SCRIPT [ARGS...]")
    script = os.path.abspath(argv[0])
    # What ``python SCRIPT ARGS`` gives the script (the interpreter's own start-up,
    # not a patch): its arguments, and its directory in place of the runner's.
    sys.argv[:] = argv
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        _note(e.code)
        raise
    except Exception as e:  # printed as Python would, then the same exit status
        _note(1)
        tb = _from_script(e.__traceback__, script)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        raise SystemExit(1) from None
    except BaseException as e:  # KeyboardInterrupt: Python reports it itself
        _note(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
