"""Command line -> :class:`LaunchConfig`: every option as ``--flag_name``,
``--flag-name`` and an environment variable ``FLEETRUN_FLAG_NAME``.

A flag on the command line wins over its variable; the variable wins over the
default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence

from fleet._errors import FleetConfigError
from fleet.launch._config import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_PROGRESS_TIMEOUT,
    FIRST_STEP_MIN,
    SILENCE_WARNING,
    UNEVEN_GRACE,
    LaunchConfig,
)
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


# name -> (type, default, help). The first name is the canonical one.
OPTIONS: dict[str, tuple[Callable[[str], object], object, str]] = {
    "nproc_per_node": (int, None, "processes on this node (default: one per visible GPU, else 1)"),
    "gpus": (_ids, None, "GPU ids, one process each, each seeing only its GPU, e.g. 0,1 "
                         "(aliases: --devices, --selected_gpus)"),
    "cpu_devices": (int, None, "run CPU processes with N (fake) CPU devices each: sets "
                               "XLA_FLAGS=--xla_force_host_platform_device_count=N, "
                               "JAX_PLATFORMS=cpu"),
    "nnodes": (int, None, "number of nodes (default 1, or the length of --ips)"),
    "node_rank": (int, None, "this node's index, 0..nnodes-1 (default 0, or found in --ips)"),
    "master": (str, None, "HOST:PORT of the coordinator on node 0 (default on one node: "
                          "127.0.0.1 and a free port)"),
    "ips": (_ids, None, "Paddle's form: every node's address, comma-separated; node 0's "
                        "is the coordinator's host (port 6070 unless --master or "
                        "--started_port says) (alias: --cluster_node_ips)"),
    "node_ip": (str, None, "this node's address in --ips: gives --node_rank (Paddle)"),
    "started_port": (int, None, "the first port of each node's workers; rank 0's is the "
                                "coordinator (Paddle; default 6070 with --ips, else free)"),
    "log_dir": (str, "log", "directory of workerlog.RANK"),
    "max_restarts": (int, 0, "restart the whole group up to N times after a failure"),
    "job_id": (str, "default", "a name for the job (FLEET_JOB_ID in every worker)"),
    "progress_timeout": (float, DEFAULT_PROGRESS_TIMEOUT,
                         "seconds a worker may be stopped, or silent after a heartbeat, "
                         "before the job fails; the first step gets at least "
                         "--first_step_min (0: never)"),
    "first_step_min": (float, FIRST_STEP_MIN,
                       "the least time in seconds a worker gets to end its first step (it "
                       "imports, builds and compiles then)"),
    "uneven_grace": (float, UNEVEN_GRACE,
                     "seconds a worker may wait in a step that a finished peer never ran "
                     "(uneven steps) before the job fails; at most --progress_timeout"),
    "silence_warning": (float, SILENCE_WARNING,
                        "seconds a worker may be silent (no heartbeat) or stopped before "
                        "the launcher warns, naming it and the time left until "
                        "--progress_timeout ends the job; again every as many seconds "
                        "while it lasts (0: never)"),
    "allow_oversubscribe": (_flag, False,
                            f"start more than {PROCESSES_PER_CORE} CPU processes per CPU "
                            "core (refused otherwise, before any starts)"),
    "join_timeout": (float, DEFAULT_JOIN_TIMEOUT,
                     "seconds the nodes of a multi-node job wait for each other before the "
                     "first start; then the job ends naming the node ranks that never "
                     "came"),
    "verbose_env": (_flag, False, "print every variable of the first worker, not only "
                                  "Paddle's five"),
}
ALIASES = {"gpus": ("devices", "selected_gpus"), "ips": ("cluster_node_ips",)}


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def build_parser(environ: Mapping[str, str] | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="fleetrun", description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the script's own --verbose is not fleetrun's --verbose_env
    )
    for name, (convert, default, help_text) in OPTIONS.items():
        flags = []
        for n in (name, *ALIASES.get(name, ())):
            flags += [f"--{n}"] + ([f"--{n.replace('_', '-')}"] if "_" in n else [])
        variable = env_name(name)
        if environ.get(variable, "") != "":
            default = _from_env(variable, environ[variable], convert)
        if convert is _flag:  # on/off: the flag alone turns it on
            parser.add_argument(*flags, dest=name, action="store_true", default=default,
                                help=f"{help_text} [env {variable}=1]")
            continue
        parser.add_argument(
            *flags, dest=name, type=convert, default=default, metavar=name.upper(),
            help=f"{help_text} [env {variable}; default {default}]",
        )
    parser.add_argument("training_script", help="the script every worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER,
                        help="arguments of the script")
    return parser


def _from_env(variable: str, text: str, convert: Callable[[str], object]) -> object:
    try:
        return convert(text)
    except ValueError:
        kind = {int: "an integer", float: "a number", _flag: "1 or 0"}.get(convert, "valid")
        raise FleetConfigError(
            f"environment variable {variable}={text!r} is not {kind}; fix or unset it"
        ) from None


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None,
               description: str | None = None) -> LaunchConfig:
    """The command line (and ``FLEETRUN_*`` variables) as an unresolved config.

    Example:
        >>> parse_args(["--nproc-per-node", "2", "train.py", "--lr", "0.1"]).nproc_per_node
        2
    """
    ns = build_parser(environ, description).parse_args(argv)
    return LaunchConfig(
        training_script=ns.training_script,
        training_script_args=tuple(ns.training_script_args),
        **{name: getattr(ns, name) for name in OPTIONS},
    )
