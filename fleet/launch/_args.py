"""Command line -> :class:`LaunchConfig`: every option as ``--flag_name``,
``--flag-name`` and an environment variable ``FLEETRUN_FLAG_NAME``; and
``fleet.spawn``'s keyword options, the same options by name (:func:`spawn_config`).

A flag on the command line wins over its variable; the variable wins over the
default.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleet._errors import FleetConfigError
from fleet.launch._config import LaunchConfig
from fleet.launch._devices import PROCESSES_PER_CORE

ENV_PREFIX = "FLEETRUN_"


def _ids(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _flag(text: str) -> bool:
    """An on/off option's environment variable: 1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


# name -> (type, help): the one description of each option, which --help shows (the
# manual, fleet/launch/_main.py, and LaunchConfig point here). Defaults: LaunchConfig's.
OPTIONS: dict[str, tuple[Callable[[str], object], str]] = {
    "nproc_per_node": (int, "processes on this node (default: one per visible GPU, else 1)"),
    "gpus": (_ids, "GPU ids, one process each, each seeing only its GPU (CUDA_VISIBLE_DEVICES "
                   "set to its id), e.g. 0,1; ids are physical and must be visible to the "
                   "launcher (aliases: --devices, --selected_gpus)"),
    "cpu_devices": (int, "run CPU processes with N (fake) CPU devices each: sets "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N, JAX_PLATFORMS=cpu"),
    "nnodes": (int, "number of nodes (default 1, or the length of --ips)"),
    "node_rank": (int, "this node's index, 0..nnodes-1 (default 0, or found in --ips)"),
    "master": (str, "HOST:PORT of the coordinator on node 0 (default on one node: 127.0.0.1 "
                    "and a free port, chosen again at each restart)"),
    "ips": (_ids, "Paddle's form: every node's address, comma-separated; node 0's is the "
                  "coordinator's host (port 6070 unless --master or --started_port says) "
                  "(alias: --cluster_node_ips)"),
    "node_ip": (str, "this node's address in --ips: gives --node_rank (Paddle); with --master "
                     "on several nodes, the address its workers listen on"),
    "started_port": (int, "the first port of each node's workers; rank 0's is the "
                          "coordinator (Paddle; default 6070 with --ips, else free)"),
    "log_dir": (str, "directory of workerlog.RANK"),
    "max_restarts": (int, "restart the whole group up to N times after a failure"),
    "job_id": (str, "a name for the job (FLEET_JOB_ID in every worker)"),
    "progress_timeout": (float, "seconds a worker may be stopped, or silent after a heartbeat, "
                                "before the job fails; the first step gets at least "
                                "--first_step_min (0: never)"),
    "first_step_min": (float, "the least time in seconds a worker gets to end its first step "
                              "(it imports, builds and compiles then)"),
    "uneven_grace": (float, "seconds a worker may wait in a step that a finished peer never "
                            "ran (uneven steps) before the job fails; at most --progress_timeout"),
    "silence_warning": (float, "seconds a worker may be silent (no heartbeat) or stopped "
                               "before the launcher warns, naming it and the time left until "
                               "--progress_timeout ends the job; again every as many seconds "
                               "while it lasts (0: never)"),
    "allow_oversubscribe": (_flag, f"start more than {PROCESSES_PER_CORE} CPU processes per "
                                   "CPU core (refused otherwise, before any starts)"),
    "join_timeout": (float, "seconds the nodes of a multi-node job wait for each other before "
                            "the first start; then the job ends naming the node ranks that "
                            "never came"),
    "verbose_env": (_flag, "print every variable of the first worker, not only Paddle's table "
                           "(its four variables, and FLAGS_selected_gpus on GPUs); implies "
                           "--print_config"),
    "print_config": (_flag, "print Paddle's launcher tables at start: the configuration "
                            "arguments and the first worker's distributed environment "
                            "(default: one line saying what starts where)"),
}
# --help shows the options in these groups, in this order (torchrun's shape).
GROUPS = {
    "processes and devices": ("nproc_per_node", "gpus", "cpu_devices", "allow_oversubscribe"),
    "several machines": ("nnodes", "node_rank", "master", "ips", "node_ip", "started_port",
                         "join_timeout"),
    "failures and stuck workers": ("max_restarts", "progress_timeout", "first_step_min",
                                   "uneven_grace", "silence_warning"),
    "output": ("log_dir", "job_id", "print_config", "verbose_env"),
}
DESCRIPTION = """\
Starts a data-parallel job: the training script once per process (one per GPU,
or N processes of CPU devices), on this machine or on several, and watches it:
a failing or stuck worker ends the job, naming its rank. Each option can also
come from the environment variable FLEETRUN_<OPTION> (the command line wins)."""
EPILOG = """\
examples:
  fleetrun --gpus 0,1 train.py --lr 0.1                  # two processes, a GPU each
  fleetrun --nproc_per_node 2 --cpu_devices 2 train.py   # no GPU: 2 x 2 CPU devices
  fleetrun --nnodes 2 --node_rank 0 --master 10.0.0.1:6070 train.py   # on node 0, then
  fleetrun --nnodes 2 --node_rank 1 --master 10.0.0.1:6070 train.py   # the same on node 1

The script calls fleet.init(is_collective=True) first. The full manual (the
workers' environment, failures, ports and trust) is docs/launch.md, and
`python -m pydoc fleet.launch`."""
ALIASES = {"gpus": ("devices", "selected_gpus"), "ips": ("cluster_node_ips",)}
DEFAULTS = {field.name: field.default for field in dataclasses.fields(LaunchConfig)}


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="fleetrun", description=DESCRIPTION, epilog=EPILOG,
        usage="fleetrun [options] training_script [script args ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the script's own --verbose is not fleetrun's --verbose_env
    )
    for title, names in GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            _add(group, name, environ)
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        metavar="training_script [script args ...]",
                        help="the script every worker runs, and its own arguments")
    return parser


_METAVARS = {"master": "HOST:PORT", "node_ip": "ADDR", "log_dir": "DIR", "job_id": "NAME"}


def _add(group: Any, name: str, environ: Mapping[str, str]) -> None:
    """``--name`` in ``group`` as --help shows it; its other spellings (``--name-x``,
    Paddle's aliases) are accepted and left out of the help."""
    convert, help_text = OPTIONS[name]
    default = DEFAULTS[name]
    others = [f"--{n}" for n in (name, *ALIASES.get(name, ())) if n != name]
    others += [f"--{n.replace('_', '-')}" for n in (name, *ALIASES.get(name, ())) if "_" in n]
    variable = env_name(name)
    if environ.get(variable, "") != "":
        default = _from_env(variable, environ[variable], convert)
    if convert is _flag:  # on/off: the flag alone turns it on
        kind, shown = {"action": "store_true"}, ""
    else:
        metavar = _METAVARS.get(name) or {int: "N", float: "SEC", _ids: "LIST"}.get(convert, "X")
        kind = {"type": convert, "metavar": metavar}
        shown = ("" if default is None else f" (default {default!r})" if isinstance(default, str)
                 else f" (default {','.join(default)})" if isinstance(default, tuple)
                 else f" (default {default:g})")
    group.add_argument(f"--{name}", dest=name, default=default, help=f"{help_text}{shown}", **kind)
    for flag in others:
        group.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                           **kind)


def _from_env(variable: str, text: str, convert: Callable[[str], object]) -> object:
    try:
        return convert(text)
    except ValueError:
        kind = {int: "an integer", float: "a number", _flag: "1 or 0"}.get(convert, "valid")
        raise FleetConfigError(
            f"environment variable {variable}={text!r} is not {kind}; fix or unset it"
        ) from None


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """The command line (and ``FLEETRUN_*`` variables) as an unresolved config.

    Example:
        >>> parse_args(["--nproc-per-node", "2", "train.py", "--lr", "0.1"]).nproc_per_node
        2
    """
    parser = build_parser(environ)
    ns = parser.parse_args(argv)
    if not ns.script:
        parser.error("the following argument is required: training_script")
    return LaunchConfig(
        training_script=ns.script[0],
        training_script_args=tuple(ns.script[1:]),
        **{name: getattr(ns, name) for name in OPTIONS},
    )


# fleetrun's options that fleet.spawn takes too, and its own ``print_config``.
_SHARED = ("cpu_devices", "gpus", "job_id", "master", "progress_timeout", "first_step_min",
           "uneven_grace", "silence_warning", "allow_oversubscribe", "verbose_env")
_NAMES = {alias: name for name in _SHARED for alias in (name, *ALIASES.get(name, ()))}
SPAWN_OPTIONS = tuple(sorted([*_SHARED, "print_config"]))
_ALIASES_TEXT = "; ".join(f"{', '.join(ALIASES[n])} for {n}" for n in _SHARED if n in ALIASES)


def spawn_config(nprocs: int, options: dict[str, Any]) -> LaunchConfig:
    """``fleet.spawn``'s ``nprocs`` and keyword options as an unresolved
    :class:`LaunchConfig`, checked before any process starts."""
    unknown = sorted(set(options) - set(SPAWN_OPTIONS) - set(_NAMES))
    if unknown:
        hints = {n: difflib.get_close_matches(n, SPAWN_OPTIONS, n=1) for n in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                         for n, h in hints.items())
        raise FleetConfigError(
            f"fleet.spawn got unknown option(s) {said}; valid options: {', '.join(SPAWN_OPTIONS)} "
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
    convert, _ = OPTIONS[name]
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
