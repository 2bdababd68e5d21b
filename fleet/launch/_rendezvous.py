"""The nodes of a multi-node job meet before any worker starts; this file holds
the protocol and node 0's side (the others' side and :func:`meet`:
``fleet/launch/_rendezvous_join.py``). What the user sees (the checks, the
waiting lines, a wrong ``--master``): the manual, ``fleet/launch/_main.py``,
"Failures".

Node 0's launcher listens on the master address, the port its rank 0 worker's
coordinator takes once every node has come; every other node's launcher
connects there and says who it is (:class:`NodeInfo`). Node 0 alone decides: it
ends the job on every node at once with the first :func:`mismatch`, or when
``--join_timeout`` passes with nodes missing. The rendezvous runs once, before
the first start (restarts are each node's own), and authenticates no peer, as
JAX's coordination service does not. The protocol is one JSON object a line,
with ``magic`` in the first of each side; a connection that does not speak it is
named in a warning and closed (by node 0) or waited past (by the others); a node
that leaves before the end is forgotten (it may come again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import selectors
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
_SELECT = 0.1  # seconds between node 0's looks at the clock and at signals
_LINGER = 2.0  # seconds node 0 waits for the others to close after the verdict


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
    with contextlib.suppress(OSError):
        sock.sendall(json.dumps({"magic": MAGIC, **message}).encode() + b"\n")


def recv(sock: socket.socket) -> bytes:
    """What a peer sent; ``b""`` once it is gone."""
    try:
        return sock.recv(65536)
    except OSError:
        return b""


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


def listen(host: str, port: int, master: str) -> socket.socket:
    """The rendezvous' listening socket on the master address (node 0's own); raises
    :class:`fleet.launch._net.NotMine` when that address is not this machine's."""
    return _net.bind(_net.resolve_ipv4(host) or host, port, master, lambda why: (
        f"node 0 cannot listen on --master {master} ({why}); pick a free port of node "
        "0's address: --master ADDR:PORT on every node"), backlog=64)


class Host:
    """Node 0's rendezvous: run :meth:`run` once."""

    def __init__(self, listener: socket.socket, me: NodeInfo, master: str, timeout: float,
                 stopped: Callable[[], int | None]):
        self.listener, self.me, self.master = listener, me, master
        self.clock, self.stopped = Clock(timeout), stopped
        self.arrived: dict[int, NodeInfo] = {0: me}
        self.buffers: dict[socket.socket, bytes] = {}
        self.nodes: dict[socket.socket, NodeInfo] = {}
        self.selector = selectors.DefaultSelector()

    def run(self) -> list[NodeInfo]:
        """Every node's hello, node rank order, once all came; raises otherwise."""
        self.selector.register(self.listener, selectors.EVENT_READ)
        try:
            while len(self.arrived) < self.me.nnodes:
                self._check_time()
                for key, _ in self.selector.select(_SELECT):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)
                    if len(self.arrived) == self.me.nnodes:
                        break
            nodes = [self.arrived[r] for r in sorted(self.arrived)]
            for sock in self.nodes:
                send(sock, {"ok": True, "nodes": [vars(n) for n in nodes]})
            self._linger()
            return nodes
        finally:
            for sock in list(self.buffers):
                self._drop(sock)
            self.selector.close()

    def _check_time(self) -> None:
        signum = self.stopped()
        if signum is not None:
            self._fail(f"node 0's launcher at {self.master} got signal {signum} and stopped "
                       "before every node came")
            raise Stopped(signum)
        if self.clock.expired():
            ranks = ", ".join(map(str, self._missing()))
            raise self._fail(
                f"node rank(s) {ranks} never came to the rendezvous at {self.master} within "
                f"--join_timeout {self.clock.timeout:g} s. Start the missing node(s) "
                f"with --nnodes {self.me.nnodes} --master {self.master} and their "
                "--node_rank, check that they reach this address (firewall, routes), or "
                "raise --join_timeout"
            )
        if self.clock.report_due():
            log.warning("%s", waiting_line(self._missing(), 0, self.me.nnodes, self.master,
                                           self.clock, f"came: {self._came()}"))

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.settimeout(2.0)  # reads follow select(); a send waits at most this long
        self.buffers[sock] = b""
        self.selector.register(sock, selectors.EVENT_READ)

    def _missing(self) -> list[int]:
        return [r for r in range(self.me.nnodes) if r not in self.arrived]

    def _came(self) -> str:
        return describe_all(list(self.arrived.values()))

    def _read(self, sock: socket.socket) -> None:
        data = recv(sock)
        if not data:
            node = self.nodes.get(sock)
            if node is not None:
                del self.arrived[node.node_rank]
                log.warning("%s left the rendezvous at %s before every node came; waiting "
                            "for it again", node.describe(), self.master)
            self._drop(sock)
            return
        self.buffers[sock] += data
        while b"\n" in self.buffers.get(sock, b""):
            line, self.buffers[sock] = self.buffers[sock].split(b"\n", 1)
            self._hello(sock, line)

    def _hello(self, sock: socket.socket, line: bytes) -> None:
        peer = _peer(sock)
        message = parse(line)
        node = None
        if message is not None and sock not in self.nodes:
            with contextlib.suppress(ValueError, TypeError):
                node = NodeInfo.from_message(message, peer)
        if node is None:
            log.warning("a connection from %s to the rendezvous at %s is not a fleetrun "
                        "node's (it sent %r); closed it. The job's network must be trusted: "
                        "only its nodes should reach this port", peer, self.master,
                        line[:80])
            self._drop(sock)
            return
        problem = mismatch(self.me, self.arrived, node)
        if problem is not None:
            self.nodes[sock] = node
            raise self._fail(problem)
        self.arrived[node.node_rank], self.nodes[sock] = node, node
        log.info("%s came to the rendezvous at %s (from %s); %d of %d nodes are here",
                 node.describe(), self.master, peer, len(self.arrived), self.me.nnodes)
        for other in self.nodes:
            send(other, {"missing": self._missing(), "came": self._came()})

    def _fail(self, problem: str) -> FleetConfigError:
        """Tells every connected node why the job ends; the error to raise here."""
        text = (f"{problem}. Nodes that came: {self._came()}; "
                f"the coordinator (node 0) is at {self.master}")
        for sock in self.nodes:
            send(sock, {"error": text})
        self._linger()
        return FleetConfigError(text)

    def _linger(self) -> None:
        """Lets the nodes read the verdict and close first (node 0's port then has no
        connection in TIME_WAIT when its coordinator takes it)."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        clock = Clock(_LINGER)
        while self.nodes and not clock.expired():
            for key, _ in self.selector.select(_SELECT):
                if key.fileobj is self.listener:
                    continue
                if not recv(key.fileobj):
                    self._drop(key.fileobj)

    def _drop(self, sock: socket.socket) -> None:
        self.buffers.pop(sock, None)
        self.nodes.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"
