"""The one base class for fleet's own errors.

Every message says what was given, what is allowed and what to do.
"""

from __future__ import annotations


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


class FleetWarning(UserWarning):
    """A warning from fleet (tests turn these into errors)."""
