"""What ``fleet.spawn`` accepts, checked before any process starts: its keyword
options (``fleetrun``'s options of the same names) and a function and arguments
that pickle."""

from __future__ import annotations

import difflib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.launch._args import ALIASES, DEFAULTS
from fleet.launch._args import OPTIONS as _CLI_OPTIONS
from fleet.launch._config import LaunchConfig

# fleetrun's options that fleet.spawn takes too (fleet/launch/_args.py is their one
# table: types, defaults, aliases), and its own ``print_config``.
_SHARED = ("cpu_devices", "gpus", "job_id", "master", "progress_timeout", "first_step_min",
           "uneven_grace", "silence_warning", "allow_oversubscribe", "verbose_env")
_NAMES = {alias: name for name in _SHARED for alias in (name, *ALIASES.get(name, ()))}
OPTIONS = tuple(sorted([*_SHARED, "print_config"]))
_ALIASES_TEXT = "; ".join(f"{', '.join(ALIASES[n])} for {n}" for n in _SHARED if n in ALIASES)


def check_picklable(func: Callable[..., Any], args: Sequence[Any]) -> None:
    """The children get ``func`` and ``args`` by pickle: refuse what will not pickle."""
    if not callable(func):
        raise FleetTypeError(f"fleet.spawn needs a function, got {type(func).__name__} {func!r}")
    name = getattr(func, "__qualname__", repr(func))
    try:
        pickle.dumps(func)
    except Exception as e:  # noqa: BLE001 (PicklingError, AttributeError, TypeError...)
        kind = ("a lambda" if "<lambda>" in name else
                "a local function" if "<locals>" in name else "not picklable")
        raise FleetTypeError(
            f"fleet.spawn cannot send {name!r} to the new processes: it is {kind} "
            f"(pickle: {type(e).__name__}: {e}). Give a function defined at the top level "
            "of an importable module (not __main__ of an interactive session), e.g. "
            "def train(lr): ... in train.py, and fleet.spawn(train, args=(0.1,))"
        ) from None
    try:
        pickle.dumps(tuple(args))
    except Exception as e:  # noqa: BLE001
        raise FleetTypeError(
            f"fleet.spawn cannot send args={args!r} to the new processes (pickle: "
            f"{type(e).__name__}: {e}); pass values that pickle (numbers, strings, arrays)"
        ) from None


def config_from_options(nprocs: int, options: dict[str, Any]) -> LaunchConfig:
    """``nprocs`` and the keyword options as an unresolved :class:`LaunchConfig`."""
    unknown = sorted(set(options) - set(OPTIONS) - set(_NAMES))
    if unknown:
        hints = {n: difflib.get_close_matches(n, OPTIONS, n=1) for n in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                         for n, h in hints.items())
        raise FleetConfigError(
            f"fleet.spawn got unknown option(s) {said}; valid options: {', '.join(OPTIONS)} "
            f"(aliases: {_ALIASES_TEXT})"
        )
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or (nprocs < 1 and nprocs != -1):
        raise FleetConfigError(
            f"nprocs={nprocs!r} must be a positive integer, or -1 for one process per "
            "visible GPU (1 without GPUs)"
        )
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key == "print_config":
            continue
        name = _NAMES[key]
        if name in values:
            raise FleetConfigError(f"fleet.spawn got {name!r} twice (as {key!r} too)")
        values[name] = _option_value(name, value)
    return LaunchConfig(nproc_per_node=None if nprocs == -1 else nprocs, **values)


def _option_value(name: str, value: Any) -> Any:
    """A keyword option as its field: text goes through fleetrun's own converter."""
    convert, _ = _CLI_OPTIONS[name]
    if value is None:
        return DEFAULTS[name]
    if name == "gpus" and not isinstance(value, str):
        value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if isinstance(value, str):
        try:
            return convert(value)
        except ValueError:
            raise FleetConfigError(f"fleet.spawn option {name}={value!r} is not valid") from None
    return float(value) if convert is float else value
