"""The two tables the launcher prints, in the layout of Paddle's launcher."""

from __future__ import annotations

from collections.abc import Mapping

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
