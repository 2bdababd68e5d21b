"""A node's side of the rendezvous (``fleet/launch/_rendezvous.py``: the protocol,
node 0's side), and :func:`meet`, which each launcher of a multi-node job calls
before its first start.

A node other than 0 connects to the master address, again every half second while
nothing answers, says hello, and waits for node 0's verdict: the list of every
node (go), or an error, which it raises as its own. It gives up at
``--join_timeout`` when no fleetrun node 0 answered, and a few seconds later than
that when one did (node 0 decides). While it waits it prints what for.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable

from fleet._errors import FleetConfigError
from fleet.launch import _net
from fleet.launch._config import LaunchConfig
from fleet.launch._rendezvous import (
    GRACE,
    PROBE,
    RETRY,
    Clock,
    Host,
    NodeInfo,
    Refused,
    Stopped,
    listen,
    parse,
    recv,
    send,
    waiting_line,
)

log = logging.getLogger("fleet.launch")


class _NotFleet(Exception):
    """What answered at the master address is not fleetrun's node 0 (or it left
    before saying anything): try again until the timeout."""


def meet(config: LaunchConfig, stopped: Callable[[], int | None]) -> list[NodeInfo]:
    """Every node of the job, once all came and agree; raises
    :class:`fleet.FleetConfigError` naming what is wrong, :class:`Stopped` on a signal.

    ``stopped`` says which signal the launcher got (``None``: none).
    """
    host, port = _net.split_host_port(config.master, "--master")
    master = f"{host}:{port}"
    address = _net.node_address(host, config.node_ip)
    note = _net.hostname_note(address)
    if note:
        log.info("%s", note)
    me = NodeInfo.of(config, address)
    started = time.monotonic()
    if config.node_rank == 0:
        with _listen_or_probe(host, port, master, me, stopped) as listener:
            nodes = Host(listener, me, master, config.join_timeout, stopped).run()
    else:
        if not _net.is_loopback(host) and _net.resolve_ipv4(host) in _net.local_addresses():
            log.warning("--master %s is an address of this machine, but this is node %d: "
                        "the coordinator runs on node 0, which listens on the master "
                        "address (is --node_rank %d right?)", master, me.node_rank,
                        me.node_rank)
        nodes = _join(host, port, master, me, Clock(config.join_timeout), stopped)
    log.info("all %d nodes came to %s in %.1f s: %s", len(nodes), master,
             time.monotonic() - started, ", ".join(n.describe() for n in nodes))
    return nodes


def _listen_or_probe(host: str, port: int, master: str, me: NodeInfo,
                     stopped: Callable[[], int | None]) -> socket.socket:
    """Node 0's listening socket; when the master address is not this machine's,
    asks whoever listens there: a node 0 that answers names both (``node rank 0 came
    twice``), else the error says the address is not this machine's."""
    try:
        return listen(host, port, master)
    except _net.NotMine as e:
        probe = Clock(PROBE)
        probe.interval = float("inf")  # no waiting lines: it is only a question
        try:
            _join(host, port, master, me, probe, stopped)
        except Refused:
            raise
        except FleetConfigError:
            pass  # nothing of fleet's answered: the address is simply not this machine's
        raise e from None  # (a node 0 never lets a second one in)


def _join(host: str, port: int, master: str, me: NodeInfo, clock: Clock,
          stopped: Callable[[], int | None]) -> list[NodeInfo]:
    timeout = clock.timeout
    why = "nothing answered yet"
    while True:
        signum = stopped()
        if signum is not None:
            raise Stopped(signum)
        if clock.expired():
            raise FleetConfigError(
                f"node {me.node_rank}: no fleetrun node 0 answered at --master {master} "
                f"within --join_timeout {timeout:g} s (last: {why}). Start node 0 with the "
                f"same --master {master} (node 0's own address and port), check that this "
                "machine reaches it (firewall, routes), or raise --join_timeout"
            )
        if clock.report_due():
            log.warning("%s", waiting_line([0], me.node_rank, me.nnodes, master, clock,
                                           f"node 0, the coordinator's: {why}"))
        try:
            sock = socket.create_connection((host, port), timeout=2.0)
        except OSError as e:
            why = e.strerror or type(e).__name__
            time.sleep(RETRY)
            continue
        try:
            with sock:
                return _wait_for_verdict(sock, master, me, clock, stopped)
        except _NotFleet as e:
            why = str(e)
            time.sleep(RETRY)


def _wait_for_verdict(sock: socket.socket, master: str, me: NodeInfo, clock: Clock,
                      stopped: Callable[[], int | None]) -> list[NodeInfo]:
    """Says hello on a connected socket and waits for node 0's verdict."""
    send(sock, vars(me))
    buffer, missing, came, spoke = b"", list(range(me.nnodes)), "?", False
    while True:
        signum = stopped()
        if signum is not None:
            raise Stopped(signum)
        if clock.expired(GRACE if spoke else 0.0):
            if not spoke:
                raise _NotFleet(f"something at {master} took the connection but said nothing")
            raise FleetConfigError(
                f"node {me.node_rank}: node 0 at {master} gave no verdict within "
                f"--join_timeout {clock.timeout:g} s (+{GRACE:g} s); missing node ranks: "
                f"{', '.join(map(str, missing))}; came: {came}"
            )
        if clock.report_due() and spoke:
            log.warning("%s", waiting_line(missing, me.node_rank, me.nnodes, master, clock,
                                           f"came: {came}"))
        ready, _, _ = select.select([sock], [], [], 0.1)
        if not ready:
            continue
        data = recv(sock)
        if not data:
            if not spoke:
                raise _NotFleet(f"something at {master} closed the connection unanswered")
            raise FleetConfigError(
                f"node {me.node_rank}: node 0's launcher at {master} went away before every "
                f"node came (missing node ranks: {', '.join(map(str, missing))}); see node "
                "0's output"
            )
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = parse(line)
            if message is None:
                raise _NotFleet(f"something at {master} that is not fleetrun's node 0 "
                                f"answered ({line[:60]!r})")
            spoke = True
            if "error" in message:
                raise Refused(f"node 0 ended the job: {message['error']}")
            if message.get("ok"):
                return [NodeInfo(**n) for n in message["nodes"]]
            missing, came = list(message.get("missing", missing)), message.get("came", came)
