"""What the launcher prints at a start: one line by default, or (``--print_config``)
the two tables in the layout of Paddle's launcher.

torchrun prints nothing before the script's output; Paddle's launcher prints a
26-row configuration table (parameter-server rows included) and the first worker's
variables. fleetrun's default is one line that says what starts where and where
the logs go; ``--print_config`` (``FLEETRUN_PRINT_CONFIG=1``) or ``--verbose_env``
brings Paddle's tables back (``tests/test_launch_output.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from fleet.launch._config import LaunchConfig

_NAME_WIDTH, _VALUE_WIDTH = 40, 45
# The rows of Paddle's own table, in its order; the others only with --verbose_env.
PADDLE_ENV_ROWS = ("PADDLE_CURRENT_ENDPOINT", "PADDLE_TRAINERS_NUM", "FLAGS_selected_gpus",
                   "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID")


def config_table(rows: Mapping[str, object]) -> str:
    """``-----------  Configuration Arguments -----------`` then ``name: value`` lines,
    in the order given."""
    lines = ["-----------  Configuration Arguments -----------"]
    lines += [f"{name}: {value}".rstrip() for name, value in rows.items()]
    lines.append("------------------------------------------------")
    return "\n".join(lines)


def env_table(environ: Mapping[str, str], verbose: bool = False) -> str:
    """The boxed ``Distributed Envs | Value`` table of one worker's variables: Paddle's
    five first (those set), then, when ``verbose``, every other one by name."""
    names = [n for n in PADDLE_ENV_ROWS if n in environ]
    if verbose:
        names += sorted(n for n in environ if n not in PADDLE_ENV_ROWS)
    width = _NAME_WIDTH + _VALUE_WIDTH + 2
    lines = [
        "    +" + "=" * width + "+",
        f"    |{'Distributed Envs':>{_NAME_WIDTH}}  {'Value':^{_VALUE_WIDTH}}|",
        "    +" + "-" * width + "+",
    ]
    for name in names:
        value = environ[name]
        if len(value) > _VALUE_WIDTH:
            value = "..." + value[-(_VALUE_WIDTH - 3):]
        lines.append(f"    |{name:>{_NAME_WIDTH}}  {value:^{_VALUE_WIDTH}}|")
    lines.append("    +" + "=" * width + "+")
    return "\n".join(lines)


def devices_phrase(config: LaunchConfig) -> str:
    """What each process of a resolved config computes on, in words."""
    n = config.nproc_per_node
    processes = f"{n} process{'es' if n != 1 else ''}"
    if config.gpus is not None:
        return f"{processes}, GPU {','.join(config.gpus)} (one each)"
    if config.cpu_devices is not None:
        each = config.cpu_devices
        return f"{processes} x {each} CPU device{'s' if each != 1 else ''}"
    return f"{processes}, each with the devices JAX finds"


def start_line(config: LaunchConfig, first_rank: int, restart: int) -> str:
    """The one line fleetrun prints at each start of its workers.

    Example:
        >>> start_line(LaunchConfig(nproc_per_node=2, cpu_devices=2, nnodes=1,
        ...                         node_rank=0, log_dir="log"), 0, 0)  # doctest: +NORMALIZE_WHITESPACE
        "fleetrun: 2 processes x 2 CPU devices on this host, job default; rank 0's output
        follows (every rank's: log/workerlog.N)"
    """
    where = ("on this host" if config.nnodes == 1 else
             f"on node {config.node_rank} of {config.nnodes} ({config.world_size} processes "
             "in the job)")
    again = f"restart {restart}: " if restart else ""
    logs = os.path.join(config.log_dir, "workerlog.N")
    return (f"fleetrun: {again}{devices_phrase(config)} {where}, job {config.job_id}; "
            f"rank {first_rank}'s output follows (every rank's: {logs})")


# gloo (inside jaxlib) writes this line to stdout once per communicator it connects,
# with no switch to turn it off (jax-ml/jax#32673). The console's echo leaves it out
# when every peer came; the worker's log keeps it, and a short count is echoed.
# gloo writes a note in pieces (``<<``), and communicators that connect at once, on
# threads of their own, interleave their notes piece by piece: one line can hold a
# note's head and a whole note, the next the head's tail (seen on 16 cores), or two
# heads and then both tails (seen on 2).
_GLOO_PIECES = (r"\[Gloo\] Rank", r"is connected to", r"peer ranks\.",
                r"Expected number of connected peer ranks is :")
_GLOO_WORDS = "|".join(_GLOO_PIECES)
_GLOO_LINE = re.compile(rf"(?:\s*(?:{_GLOO_WORDS}|\d+(?!\d)))*")
_GLOO_COUNTS = re.compile(r"(?:is connected to|peer ranks is :) (\d+)")


def quiet_line(line: str) -> bool:
    """Whether the console's echo of a worker's log leaves ``line`` out: pieces of
    gloo's "connected to K of K peers" notes only, whole or interleaved (the worker's
    log file keeps them). A line of numbers alone, a note among other words, or one
    whose counts differ (a peer missing) is echoed."""
    line = line.strip()
    if not _GLOO_LINE.fullmatch(line) or not re.search(_GLOO_WORDS, line):
        return False
    connected, expected = [], []
    for found in _GLOO_COUNTS.finditer(line):
        (connected if found.group(0).startswith("is") else expected).append(found.group(1))
    # Each note's two counts are equal when every peer came, so a line of whole or
    # interleaved notes holds as many of one as of the other, the same numbers; a
    # line cut inside a note holds only some of them, each the note's own.
    if len(connected) == len(expected):
        return sorted(connected) == sorted(expected)
    return len(set(connected + expected)) <= 1
