"""Node 0's side of the rendezvous (``fleet/launch/_rendezvous.py``): listen on the
master address, take each node's hello, check it, and tell every node the verdict.

Node 0 alone decides: it ends the rendezvous on every node at once with the first
mismatch (two nodes with one rank, different process counts, another job), or when
``--join_timeout`` passes with nodes missing, naming them and the nodes that came.
A connection that does not speak the protocol is named in a warning and closed; a
node that leaves before the end is forgotten (it may come again).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
from collections.abc import Callable

from fleet._errors import FleetConfigError
from fleet.launch import _net
from fleet.launch._rendezvous import (
    Clock,
    NodeInfo,
    Stopped,
    describe_all,
    mismatch,
    parse,
    send,
    waiting_line,
)

log = logging.getLogger("fleet.launch")

_SELECT = 0.1  # seconds between looks at the clock and at signals
_LINGER = 2.0  # seconds node 0 waits for the others to close after the verdict


class NotMine(FleetConfigError):
    """The master address is not this machine's, so node 0 cannot listen there."""


def listen(host: str, port: int, master: str) -> socket.socket:
    """The rendezvous' listening socket on the master address (node 0's own)."""
    address = _net.resolve_ipv4(host) or host
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(64)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            raise NotMine(_net.not_mine(master, address)) from None
        raise FleetConfigError(
            f"node 0 cannot listen on --master {master} ({e.strerror}); pick a free port "
            "of node 0's address: --master ADDR:PORT on every node"
        ) from None
    return sock


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
        missing = [r for r in range(self.me.nnodes) if r not in self.arrived]
        if self.clock.expired():
            ranks = ", ".join(map(str, missing))
            raise self._fail(
                f"node rank(s) {ranks} never came to the rendezvous at {self.master} within "
                f"--join_timeout {self.clock.timeout:g} s. Start the missing node(s) "
                f"with --nnodes {self.me.nnodes} --master {self.master} and their "
                "--node_rank, check that they reach this address (firewall, routes), or "
                "raise --join_timeout"
            )
        if self.clock.report_due():
            log.warning("%s", waiting_line(missing, 0, self.me.nnodes, self.master, self.clock,
                                           f"came: {describe_all(list(self.arrived.values()))}"))

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.settimeout(2.0)  # reads follow select(); a send waits at most this long
        self.buffers[sock] = b""
        self.selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
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
        missing = [r for r in range(self.me.nnodes) if r not in self.arrived]
        came = describe_all(list(self.arrived.values()))
        for other in self.nodes:
            send(other, {"missing": missing, "came": came})

    def _fail(self, problem: str) -> FleetConfigError:
        """Tells every connected node why the job ends; the error to raise here."""
        text = (f"{problem}. Nodes that came: {describe_all(list(self.arrived.values()))}; "
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
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock)

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
