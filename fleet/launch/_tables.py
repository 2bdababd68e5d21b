"""The two tables the launcher prints, in the layout of Paddle's launcher."""

from __future__ import annotations

from collections.abc import Mapping

_NAME_WIDTH, _VALUE_WIDTH = 40, 45


def config_table(rows: Mapping[str, object]) -> str:
    """``-----------  Configuration Arguments -----------`` then ``name: value`` lines."""
    lines = ["-----------  Configuration Arguments -----------"]
    lines += [f"{name}: {value}" for name, value in sorted(rows.items())]
    lines.append("------------------------------------------------")
    return "\n".join(lines)


def env_table(environ: Mapping[str, str]) -> str:
    """The boxed ``Distributed Envs | Value`` table of one worker's variables."""
    width = _NAME_WIDTH + _VALUE_WIDTH + 2
    lines = [
        "    +" + "=" * width + "+",
        f"    |{'Distributed Envs':>{_NAME_WIDTH}}  {'Value':^{_VALUE_WIDTH}}|",
        "    +" + "-" * width + "+",
    ]
    for name in sorted(environ):
        value = environ[name]
        if len(value) > _VALUE_WIDTH:
            value = "..." + value[-(_VALUE_WIDTH - 3):]
        lines.append(f"    |{name:>{_NAME_WIDTH}}  {value:^{_VALUE_WIDTH}}|")
    lines.append("    +" + "=" * width + "+")
    return "\n".join(lines)
