"""The one base class for fleet's own errors, and how a message names an argument.

Every message says what was given, what is allowed and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable


class FleetError(Exception):
    """Base class of every error fleet raises on purpose."""


class FleetConfigError(FleetError, ValueError):
    """A configuration value (strategy field, argument) is not allowed."""


class FleetTypeError(FleetError, TypeError):
    """A value has the wrong type."""


class FleetNotInitializedError(FleetError, RuntimeError):
    """fleet.init() has not been called yet."""


class FleetUnsupportedError(FleetError, NotImplementedError):
    """A feature that fleet does not support (yet)."""


class FleetAttributeError(FleetError, AttributeError):
    """An unknown field name (``hasattr`` still answers ``False``)."""


class SummedLossError(FleetError):
    """A loss summed over the batch rows, refused (fleet.semantics): a step whose rows
    are mixed as well is refused for that first (fleet.step._program)."""


class FleetWarning(UserWarning):
    """A warning from fleet (tests turn these into errors)."""


def nth(position: int) -> str:
    """``"the 3rd argument"`` for position 2: a message counts arguments from 1, as
    a reader does (``batch_argnums`` and JAX's ``args[2]`` count from 0)."""
    n = position + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"the {n}{suffix} argument"


def batch_rows(rows: Iterable[int]) -> str:
    """``"8 or 16 batch rows"``: the row counts of a batch's leaves, as the trace that
    raises sees them (the replica's, or the global batch's in the one-device check)."""
    return " or ".join(map(str, sorted(rows))) + " batch rows"
