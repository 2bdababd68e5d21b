"""fleetrun: start a data-parallel job, one process per device group, and watch it.

``fleetrun`` and ``python -m fleet.launch`` are the same program, the port of
Paddle's ``fleetrun`` / ``python -m paddle.distributed.launch`` to JAX's own
distributed runtime (``jax.distributed``: a coordinator in process 0, gloo
collectives on CPU, NCCL on GPU).

Usage
-----

One machine, one process per visible GPU (each sees only its GPU)::

    fleetrun train.py --lr 0.1
    fleetrun --gpus 0,1 train.py                 # two processes: GPU 0 and GPU 1

One machine without GPUs, for development and tests: 2 processes with 2 CPU
devices each (4 data-parallel replicas)::

    fleetrun --nproc_per_node 2 --cpu_devices 2 train.py

Several machines: the same command on each, with the node's index::

    fleetrun --nnodes 2 --node_rank 0 --master 10.0.0.1:6070 --gpus 0,1 train.py   # on 10.0.0.1
    fleetrun --nnodes 2 --node_rank 1 --master 10.0.0.1:6070 --gpus 0,1 train.py   # on 10.0.0.2

or Paddle's form, where each machine finds its own index in the list::

    fleetrun --ips 10.0.0.1,10.0.0.2 --gpus 0,1 train.py

or Paddle's older spelling of it, where each machine names itself::

    python -m fleet.launch --cluster_node_ips=10.0.0.1,10.0.0.2 --node_ip=10.0.0.2 \
        --started_port=6170 --selected_gpus=0,1 train.py

A job started by a cluster's own launcher needs no fleetrun: under SLURM's
``srun -n 4 python train.py`` (or Open MPI 4's ``mpirun``) ``fleet.init`` finds
its place from the cluster's variables and joins through JAX's own cluster
detection (``fleet/runtime/_env.py``).

The script calls ``fleet.init(is_collective=True)`` (or Paddle's
``fleet.init_parallel_env()``) first; it reads the environment below.

Options
-------

Every option is spelled ``--flag_name`` or ``--flag-name`` and can also come from
the environment variable ``FLEETRUN_FLAG_NAME`` (the command line wins);
``fleetrun --help`` lists them, by group, with their defaults (their one table:
``OPTIONS`` in ``fleet/launch/_args.py``).

What each worker gets
---------------------

``FLEET_RANK`` / ``PADDLE_TRAINER_ID`` (global rank), ``FLEET_WORLD_SIZE`` /
``PADDLE_TRAINERS_NUM``, ``FLEET_LOCAL_RANK``, ``FLEET_LOCAL_WORLD_SIZE``,
``FLEET_NODE_RANK``, ``FLEET_NNODES``, ``FLEET_COORDINATOR`` (``host:port``),
``FLEET_CURRENT_ENDPOINT`` / ``PADDLE_CURRENT_ENDPOINT``, ``FLEET_TRAINER_ENDPOINTS``
/ ``PADDLE_TRAINER_ENDPOINTS`` (all endpoints, rank order; left out with
``--master`` on several nodes, where other nodes' addresses are unknown),
``FLEET_RESTART_COUNT`` (0, then 1, 2... after restarts: resume from your last
checkpoint), ``FLEET_JOB_ID``, ``FLEET_HEARTBEAT_FILE`` (see below), and
``PYTHONUNBUFFERED=1``. GPU workers get ``CUDA_VISIBLE_DEVICES`` (their GPU only)
and Paddle's ``FLAGS_selected_gpus`` (its physical id). Rank 0 also gets
``JAX_COORDINATOR_BIND_ADDRESS``: its coordinator listens on the master address only
(loopback on a single node). ``FLEET_GLOO_ADDRESS`` is where the workers' gloo (CPU
collectives) listeners bind and what they tell their peers: 127.0.0.1 on a single
node; on several, ``--node_ip`` or the address of the interface that reaches the
master, never what the hostname resolves to (Debian's default ``/etc/hosts`` maps
it to 127.0.1.1, which no other node reaches).

``FLEET_JAX_HEARTBEAT_TIMEOUT`` (set by the launcher to at least 100 s and 30 s more
than ``--progress_timeout``) and ``FLEET_JAX_INIT_TIMEOUT`` (yours to set; JAX's
default is 300 s) are passed by ``fleet.init`` to ``jax.distributed.initialize``.
Before that, a worker other than rank 0 waits up to ``FLEET_JAX_INIT_TIMEOUT`` for
the coordinator's port to answer a TCP connect, then ends with an error naming the
address and the variables it came from (``fleet/runtime/_coordinator.py``).

Output
------

At each start the launcher prints one line, what starts where and where the logs
go (``fleetrun: 2 processes x 2 CPU devices on this host, job default; rank 0's
output follows (every rank's: log/workerlog.N)``); with ``--print_config`` (or
``--verbose_env``), Paddle's tables instead: its configuration (Paddle's nine rows
first, as given, then fleet's, resolved) and its first worker's Paddle variables
(every variable with ``--verbose_env``). Worker ``N`` writes
``LOG_DIR/workerlog.N`` (global rank; after a restart the file goes on after a
``----- restart K -----`` line). This node's first worker is echoed live on the
console as it wrote it (rank 0 on node 0, as Paddle does; without
``--print_config`` the echo leaves out gloo's ``[Gloo] Rank N is connected to K
peer ranks`` notes when all K peers came, which the log keeps); the last lines of
a failed worker, which mix with it, are prefixed ``[rank N]``. The launcher's own
lines (``INFO`` / ``WARNING`` / ``ERROR``) go to stderr.

Failures
--------

* A worker exits non-zero or dies of a signal: the launcher names it (``rank 1
  (pid 4242) was killed by signal SIGKILL (9)``), stops the others (``SIGTERM``,
  ``SIGKILL`` 3 s later: JAX workers ignore ``SIGTERM``), prints the last lines of
  its log and exits with its exit code (128 + N for signal N).
* A stuck worker: stopped (``SIGSTOP``) for ``--progress_timeout`` seconds, or
  silent that long after a heartbeat (``fleet.distributed_step`` sends two per
  step; scripts with their own loop call ``fleet.launch.heartbeat()``), or with
  no heartbeat at all ``max(--progress_timeout, --first_step_min)`` seconds after its start
  (stuck before its first step, e.g. in a collective call one rank made alone).
  The job ends naming the rank furthest behind; exit code 124. Long before
  that, after ``--silence_warning`` seconds (60) of silence and then every as
  many seconds, a ``WARNING`` line names the silent rank, its pid, how long it
  has been silent (and whether it is stopped) and when the job will be ended.
  A worker that finished (exit 0, or its script ended and it waits for its
  peers in JAX's shutdown) is never blamed.
* Uneven steps: a worker finished after N steps while a peer started step N + 1
  and has been silent since for ``min(--progress_timeout, --uneven_grace)`` seconds. The job
  ends naming the rank that ran more steps and both step counts, in its last line
  too; exit code 124.
  With the defaults this ends the job within about 15 s.
* ``Ctrl-C`` / ``SIGTERM`` / ``SIGHUP`` to the launcher: every worker's process
  group is stopped the same way (a second signal skips the grace); exit code
  128 + N. Workers also die if the launcher is killed outright (``SIGKILL``).
* Several nodes meet before the first start (``fleet/launch/_rendezvous.py``):
  node 0's launcher listens on the master address, the others connect there and
  say their node rank, ``--nnodes``, ``--nproc_per_node`` and ``--job_id``. Two
  nodes with one ``--node_rank``, different process counts, different
  ``--nnodes`` or another job end every node at once (exit code 2), naming the
  mismatch, the nodes that came (hostname, address, processes) and the
  coordinator's address. A missing node: every launcher prints ``waiting for 1
  of 2 nodes at ADDR:PORT, 30 s of 300 s`` every 30 s and ends at
  ``--join_timeout`` naming the missing node ranks. A ``--master`` that is not
  node 0's own address is refused on node 0 at once; the other nodes end at
  their ``--join_timeout``, having warned when the address is their own.
* Bad input fails before any worker starts (exit code 2): a missing script, a
  ``--log_dir`` that cannot be written (a read-only file system), a taken
  ``--master`` port, GPU ids that do not exist, ``--node_rank`` outside
  ``--nnodes``, more processes than the machine holds (more than its visible
  GPUs; more than 8 CPU processes per CPU core without ``--allow_oversubscribe``).

With ``--max_restarts N`` a failure stops the whole group and starts it again,
up to N times, with ``FLEET_RESTART_COUNT`` counting the restarts; on one node
the coordinator gets a fresh port each time. Each launcher restarts only its own
node: in a multi-node job the other nodes' workers fail when their peers go, so
their launchers restart too, each counting its own restarts (the nodes meet
before the first start only: give every node the same ``--max_restarts``).

Ports and trust
---------------

A job opens, on one node, the coordinator's port on 127.0.0.1 and one gloo port
(the OS picks it) per worker on 127.0.0.1. On several nodes: node 0's launcher
listens on the master address (``--master``'s port) until every node has come,
then its rank 0 worker's coordinator takes that port, on that address only; each
worker's gloo port is on its node's address (``FLEET_GLOO_ADDRESS``); GPU workers'
NCCL picks its own (``NCCL_SOCKET_IFNAME``). Nothing authenticates a peer (JAX's
coordination service does not either): a process that reaches these ports can
join, or break, the job. Run multi-node jobs on a trusted network, as for torch
and NCCL. What fleet can tell it names: a node rank that came twice, a connection
to the rendezvous that is not a fleetrun node's.

Each worker runs the script through ``fleet/launch/_run.py`` (as ``python
SCRIPT ARGS`` would), which sees how the script ends: a worker that raises, or
exits non-zero (``sys.exit``, ``raise SystemExit``), after ``fleet.init`` exits
at once instead of waiting in ``jax.distributed``'s shutdown barrier for peers
that wait for it (``fleet/runtime/_worker.py``).

From Python, ``fleet.spawn(func, args, nprocs)`` starts processes the same way
(see ``fleet/launch/_spawn.py``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from fleet._errors import FleetConfigError
from fleet.launch import _tables
from fleet.launch._agent import launch
from fleet.launch._args import parse_args
from fleet.launch._config import make_log_dir, resolve

_LOG_FORMAT = "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"


def _setup_logging() -> None:
    logger = logging.getLogger("fleet.launch")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fleetrun`` command; returns its exit code.

    Example:
        >>> main(["--nproc_per_node", "2", "--cpu_devices", "2", "train.py"])  # doctest: +SKIP
        0
    """
    _setup_logging()
    try:
        given = parse_args(argv)
        config = resolve(given)
        make_log_dir(config.log_dir)
    except FleetConfigError as e:
        print(f"fleetrun: error: {e}", file=sys.stderr)
        return 2
    if config.tables:
        print(_tables.config_table(config.table(given)), flush=True)
    return launch(config)
