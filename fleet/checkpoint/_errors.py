"""The errors ``fleet.checkpoint`` raises besides fleet's common ones.

:class:`FleetCheckpointError` subclasses :class:`fleet.FleetError`, so ``except
fleet.FleetError`` catches it; :class:`Damaged`, a step that cannot be read as it
was written, subclasses it in turn (``restore_latest`` skips such a step).
"""

from __future__ import annotations

from fleet._errors import FleetError


class FleetCheckpointError(FleetError, ValueError):
    """A checkpoint that cannot be written or does not fit what it is loaded into.

    Nothing was changed when it is raised: the message lists every difference.
    """


class Damaged(FleetCheckpointError):
    """A step that cannot be read as it was written (``restore_latest`` skips it)."""


def first_line(e: BaseException) -> str:
    """``"OSError: [Errno 28] No space left on device"``: an error, in brief, for a message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"
