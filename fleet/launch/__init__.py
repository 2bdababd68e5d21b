"""Starting jobs: ``fleetrun`` / ``python -m fleet.launch`` and ``fleet.spawn``.

The manual is ``fleetrun --help`` (the docstring of ``fleet/launch/_main.py``).
The stages are separate and each can be used alone::

    config = parse_args(["--nproc_per_node", "2", "--cpu_devices", "2", "train.py"])
    config = resolve(config)       # validated, machine defaults filled in; frozen
    exit_code = launch(config)     # runs this node's workers until they finish
"""

from fleet.launch._agent import launch
from fleet.launch._args import parse_args
from fleet.launch._config import LaunchConfig, plan_workers, resolve
from fleet.launch._failure import WorkerFailedError
from fleet.launch._heartbeat import heartbeat
from fleet.launch._main import main
from fleet.launch._spawn import SpawnContext, spawn

__all__ = [
    "LaunchConfig",
    "SpawnContext",
    "WorkerFailedError",
    "heartbeat",
    "launch",
    "main",
    "parse_args",
    "plan_workers",
    "resolve",
    "spawn",
]
