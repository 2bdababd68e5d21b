"""The nodes of a multi-node job meet before any worker starts.

Node 0's launcher listens on the master address (``--master HOST:PORT``, the
port its rank 0 worker's coordinator takes once every node has come); every
other node's launcher connects there and says who it is: its node rank, the
job's ``--nnodes``, its ``--nproc_per_node``, ``--job_id``, hostname and
address. Node 0 checks each arrival against its own and ends the job on every
node at once, naming the mismatch, when

* two nodes give the same ``--node_rank``;
* two nodes give different ``--nproc_per_node`` or ``--nnodes``;
* a node gives another ``--job_id`` (another job, or a typo).

While nodes are missing every launcher prints what it waits for (``waiting for
1 of 2 nodes at 10.0.0.1:6070, 30 s of 300 s``) every 30 s (every tenth of
``--join_timeout`` if shorter, at least 1 s), and at ``--join_timeout`` ends with an error
naming the node ranks that never came. A node whose ``--master`` is wrong
(nothing of fleet's answers there) ends at its own timeout; node 0 refuses a
``--master`` that is not its own address at once, after asking whoever listens
there whether it is node 0 too (then both end, naming each other).

The rendezvous runs once, before the first start: restarts (``--max_restarts``)
are each node's own (``fleet/launch/_main.py``). Nothing here authenticates a
peer, as JAX's coordination service does not: the job's network must be
trusted. The protocol is one JSON object a line, with ``magic`` in the first
of each side; anything else on the port is ignored (by node 0) or waited past
(by the others).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from collections.abc import Callable

from fleet._errors import FleetConfigError
from fleet.launch import _net
from fleet.launch._config import LaunchConfig

log = logging.getLogger("fleet.launch")

MAGIC = "fleetrun-rendezvous/1"
REPORT_EVERY = 30.0  # seconds between waiting lines (at most)
RETRY = 0.5  # seconds between a node's attempts to reach node 0
GRACE = 5.0  # a node waits this much past its own timeout for node 0's verdict


PROBE = 3.0  # seconds a node 0 that cannot listen on the master asks who does


class Refused(FleetConfigError):
    """Node 0 ended the rendezvous (a mismatch, or nodes missing): its words."""


class Stopped(Exception):
    """The launcher got a signal while it waited (its exit code: 128 + ``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What one node's launcher says of itself."""

    node_rank: int
    nnodes: int
    nproc_per_node: int
    job_id: str
    hostname: str
    address: str

    @classmethod
    def of(cls, config: LaunchConfig, address: str) -> NodeInfo:
        return cls(config.node_rank, config.nnodes, config.nproc_per_node, config.job_id,
                   socket.gethostname(), address)

    @classmethod
    def from_message(cls, message: dict, seen_from: str) -> NodeInfo:
        """A node's hello; its address as node 0 saw it when it says none."""
        fields = {f.name: message.get(f.name) for f in dataclasses.fields(cls)}
        for name in ("node_rank", "nnodes", "nproc_per_node"):
            if not isinstance(fields[name], int):
                raise ValueError(name)
        fields["address"] = str(fields["address"] or seen_from)
        fields["hostname"], fields["job_id"] = str(fields["hostname"]), str(fields["job_id"])
        return cls(**fields)

    def describe(self) -> str:
        processes = "process" if self.nproc_per_node == 1 else "processes"
        return (f"node {self.node_rank} ({self.hostname}, {self.address}, "
                f"{self.nproc_per_node} {processes}, --nnodes {self.nnodes})")


def describe_all(nodes: list[NodeInfo]) -> str:
    return ", ".join(n.describe() for n in sorted(nodes, key=lambda n: n.node_rank)) or "none"


def mismatch(me: NodeInfo, arrived: dict[int, NodeInfo], new: NodeInfo) -> str | None:
    """Why ``new`` cannot join the job node 0 (``me``) leads, or ``None``."""
    if new.job_id != me.job_id:
        return (f"{new.describe()} says --job_id {new.job_id!r} but node 0 says "
                f"{me.job_id!r}: it belongs to another job; give every node of one job the "
                "same --job_id, and each job its own --master port")
    if new.nnodes != me.nnodes:
        return (f"{new.describe()} says --nnodes {new.nnodes} but node 0 says --nnodes "
                f"{me.nnodes}; give every node the same --nnodes")
    if new.nproc_per_node != me.nproc_per_node:
        return (f"{new.describe()} has {new.nproc_per_node} processes (--nproc_per_node, "
                f"or --gpus) but node 0 has {me.nproc_per_node}; every node must start "
                "the same number of processes")
    if new.node_rank in arrived:
        return (f"node rank {new.node_rank} came twice: {arrived[new.node_rank].describe()} "
                f"and {new.describe()}; give each node its own --node_rank, 0.."
                f"{me.nnodes - 1}")
    if not 0 <= new.node_rank < me.nnodes:
        return (f"{new.describe()} is outside --nnodes {me.nnodes}; number the nodes "
                f"0..{me.nnodes - 1}")
    return None


class Clock:
    """The join's deadline and the times of its waiting lines."""

    def __init__(self, timeout: float, now: Callable[[], float] = time.monotonic):
        self.timeout, self._now = timeout, now
        self.started = now()
        self.interval = min(REPORT_EVERY, max(timeout / 10, 1.0))
        self._next_report = self.started + self.interval

    @property
    def elapsed(self) -> float:
        return self._now() - self.started

    def expired(self, grace: float = 0.0) -> bool:
        return self.elapsed >= self.timeout + grace

    def report_due(self) -> bool:
        """Whether a waiting line is due now (then the next one is scheduled)."""
        if self._now() < self._next_report:
            return False
        self._next_report += self.interval * max(1, int((self._now() - self._next_report)
                                                        / self.interval) + 1)
        return True

    def of_total(self) -> str:
        return f"{self.elapsed:.0f} s of {self.timeout:g} s"


def send(sock: socket.socket, message: dict) -> None:
    """One JSON line to a peer; a peer that is gone is left to its reader."""
    try:
        sock.sendall(json.dumps({"magic": MAGIC, **message}).encode() + b"\n")
    except OSError:
        pass


def parse(line: bytes) -> dict | None:
    """One line of the protocol, or ``None`` if it is not fleetrun's."""
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(message, dict) or message.get("magic") != MAGIC:
        return None
    return message


def waiting_line(missing: list[int], me_rank: int, nnodes: int, master: str, clock: Clock,
                 detail: str) -> str:
    ranks = ", ".join(map(str, missing))
    what = "node rank" if len(missing) == 1 else "node ranks"
    return (f"node {me_rank}: waiting for {len(missing)} of {nnodes} nodes at {master}, "
            f"{clock.of_total()} (--join_timeout; missing {what} {ranks}; {detail})")


def config_join(config: LaunchConfig) -> tuple[str, int, str]:
    """``(host, port, "host:port")`` of the rendezvous: the master address."""
    host, port = _net.split_host_port(config.master, "--master")
    return host, port, f"{host}:{port}"
