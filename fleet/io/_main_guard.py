"""The ``if __name__ == "__main__":`` guard that worker processes need.

``DataLoader(num_workers=N)`` starts its workers with ``spawn``, which imports
the main script again in each worker (as ``__mp_main__``). Code of the script
that is not under the guard then runs again in every worker; a DataLoader used
there tries to start workers of its own during the worker's start-up, Python
refuses, and the worker dies with a message that only the worker's stderr shows.

:func:`check` finds that case before any worker starts: the line of the main
script that led to this call (its outermost frame) is not inside a module-level
``if __name__ == "__main__":`` block. It reads the script's source with
``ast``; a main module with no source file (an interactive session, ``python
-c``) is not checked.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import sys

from fleet._errors import FleetConfigError


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str, mtime: float) -> tuple[tuple[int, int], ...]:
    """The line ranges of ``path``'s module-level ``if __name__ == "__main__":`` bodies."""
    del mtime  # part of the cache key only: an edited script is read again
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return tuple((node.body[0].lineno, node.end_lineno or node.body[-1].lineno)
                 for node in tree.body if isinstance(node, ast.If) and _is_main_test(node.test))


def unguarded_line() -> tuple[str, int] | None:
    """``(script, line)`` when this call comes from the main script's module-level
    code outside its ``__main__`` guard; ``None`` otherwise (or when unknown)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    line = None
    frame = inspect.currentframe()
    while frame is not None:  # the outermost module-level frame of the main script wins
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return None
    try:
        ranges = _guarded_lines(path, os.stat(path).st_mtime)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return None if any(a <= line <= b for a, b in ranges) else (path, line)


def check(num_workers: int) -> None:
    """Raises before ``num_workers`` workers start from unguarded main-script code."""
    found = unguarded_line()
    if found is None:
        return
    path, line = found
    raise FleetConfigError(
        f"DataLoader(num_workers={num_workers}) is used from line {line} of {path}, "
        "outside an `if __name__ == \"__main__\":` block. Its worker processes start "
        "with spawn, which imports the script again in each worker, where that line "
        "would run again (Python refuses, and the workers die). Put the script's "
        "training code under the guard (def main(): ...  then  if __name__ == "
        "\"__main__\": main()), or use num_workers=0")
