"""The error ``fleet.checkpoint`` raises besides fleet's common ones.

It subclasses :class:`fleet.FleetError`, so ``except fleet.FleetError`` catches it.
"""

from __future__ import annotations

from fleet._errors import FleetError


class FleetCheckpointError(FleetError, ValueError):
    """A checkpoint that cannot be written or does not fit what it is loaded into.

    Nothing was changed when it is raised: the message lists every difference.
    """
