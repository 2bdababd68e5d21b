"""The errors ``fleet.io`` raises besides fleet's common ones.

They subclass :class:`fleet.FleetError`, so ``except fleet.FleetError`` catches them.
"""

from __future__ import annotations

from fleet._errors import FleetError


class FleetDataError(FleetError, ValueError):
    """A sample or batch the loader cannot use (samples of different shapes, ...)."""


class FleetWorkerError(FleetError, RuntimeError):
    """A DataLoader worker process died, or failed in a way that cannot be re-raised."""
