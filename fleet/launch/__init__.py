"""Starting jobs: ``fleetrun`` / ``python -m fleet.launch`` and ``fleet.spawn``.

The manual is the docstring of ``fleet/launch/_main.py`` (``python -m pydoc
fleet.launch._main``); ``fleetrun --help`` lists the options.
The stages are separate and each can be used alone::

    config = parse_args(["--nproc_per_node", "2", "--cpu_devices", "2", "train.py"])
    config = resolve(config)       # validated, machine defaults filled in; frozen
    exit_code = launch(config)     # runs this node's workers until they finish

What the folder holds, one idea a file:

* ``_main.py``: the ``fleetrun`` command and its manual; ``__main__.py``: ``python
  -m fleet.launch``.
* ``_args.py``: the command line and ``FLEETRUN_*`` variables, or ``fleet.spawn``'s
  keyword options -> :class:`LaunchConfig`.
* ``_config.py``: :class:`LaunchConfig`, :func:`resolve` (checks, machine
  defaults), ``--log_dir`` made and written to once before any start;
  ``_worker_plan.py``: :func:`plan_workers` (each worker's environment);
  ``_devices.py`` (GPUs, CPU devices) and ``_net.py`` (addresses, ports) serve
  them; ``_tables.py``: what the launcher prints at a start.
* ``_supervisor.py``: the one supervisor of both launchers: waits for the
  workers' exits, runs the watchdog, names the culprit, stops the rest.
  ``_watchdog.py``: stuck workers (process state, heartbeat files);
  ``_failure.py``: what went wrong, in words.
* ``_rendezvous.py``: how the nodes of a multi-node job meet before the first
  start (the protocol, the checks, the waiting lines) and node 0's side;
  ``_rendezvous_join.py``: the other nodes' side and :func:`meet`.
* ``_agent.py``: ``fleetrun``'s adapter: workers as ``Popen`` of the script, the
  echo of worker 0's log, signals, the report, restarts. ``_run.py``: what each
  ``fleetrun`` worker runs (by path; it imports nothing from fleet).
* ``_spawn.py``: ``fleet.spawn``'s adapter: ``multiprocessing`` children that send
  their result or traceback over a pipe.

What it may import: the standard library and fleet's lower layers, at module level:
the core (``fleet._errors``, ``fleet.runtime._env``, ``fleet.runtime._worker``,
``fleet.runtime._xla_flags``), ``fleet.io._main_guard`` (``fleet.spawn`` needs the
``__main__`` guard as a DataLoader's workers do) and ``fleet.checkpoint._disk`` (what
an ``errno`` says of a directory). The core
never imports ``fleet.launch`` (``tests/test_launch_config.py`` checks); only
``fleet/__init__.py`` re-exports :func:`spawn`.
"""

# heartbeat(), the worker side of the liveness signal, lives in the core (fleet/runtime/_heartbeat.py).
from fleet.launch._agent import launch
from fleet.launch._args import parse_args
from fleet.launch._config import LaunchConfig, resolve
from fleet.launch._failure import WorkerFailedError
from fleet.launch._main import main
from fleet.launch._spawn import SpawnContext, spawn
from fleet.launch._worker_plan import plan_workers
from fleet.runtime._heartbeat import heartbeat

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
