"""Addresses and ports: free ports, "is this port taken", "is this address mine"."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import socket
import struct
from collections.abc import Callable

from fleet._errors import FleetConfigError

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux's ioctl: an interface's IPv4 address


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, with a clear error for anything else."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise FleetConfigError(
            f"{what}={address!r} is not host:port (e.g. 127.0.0.1:6070, port 1..65535)"
        )
    return host.strip("[]"), int(port_text)


def free_port(host: str = LOOPBACK) -> int:
    """A port on ``host`` that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NotMine(FleetConfigError):
    """The master address is not this machine's, so nothing here can listen there."""


def bind(host: str, port: int, master: str, taken: Callable[[str], str],
         backlog: int = 0) -> socket.socket:
    """A socket bound to ``host:port`` (listening when ``backlog``), or the error of
    a ``--master`` that cannot be: :class:`NotMine` when ``host`` is not this
    machine's, else ``taken(why)``. REUSEADDR: a port in TIME_WAIT (a previous run)
    is free; one in LISTEN is not."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if backlog:
            sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            raise NotMine(not_mine(master, host)) from None
        raise FleetConfigError(taken(e.strerror)) from None
    return sock


def check_port_free(host: str, port: int) -> None:
    """Fails before any worker starts if ``host:port`` cannot be listened on."""
    bind(host, port, f"{host}:{port}", lambda why: (
        f"port {port} on {host or 'all interfaces'} is already in use (or cannot be "
        f"bound: {why}); the coordinator of process 0 must listen there. Pick a free "
        "port with --master host:PORT, or leave --master out on a single node and fleet "
        "picks one")).close()


def not_mine(master: str, address: str) -> str:
    """The error of a ``--master`` whose address is not node 0's own."""
    mine = sorted(a for a in local_addresses()
                  if a.replace(".", "").isdigit() and not is_loopback(a))
    return (f"--master {master} ({address}) is not an address of this machine "
            f"({socket.gethostname()}, node 0: {', '.join(mine) or 'loopback only'}); the "
            "coordinator runs on node 0 and listens on the master address: give node 0's "
            "own address in --master, the same on every node")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def local_addresses() -> set[str]:
    """This machine's addresses, as far as name resolution can tell (no extra packages)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addresses = {LOOPBACK, "::1", "localhost"} | names
    for name in names:
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(name, None):
                addresses.add(info[4][0])
    addresses |= interface_addresses()
    with contextlib.suppress(OSError):
        # The address the default route leaves from (connect on UDP sends nothing).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addresses.add(s.getsockname()[0])
    return addresses


def interface_addresses() -> set[str]:
    """The IPv4 address of each of this machine's network interfaces (Linux's
    ``SIOCGIFADDR``; empty where it is not available)."""
    addresses = set()
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, \
                    contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
                addresses.add(socket.inet_ntoa(packed[20:24]))
    return addresses


def resolve_ipv4(host: str) -> str | None:
    """``host``'s first IPv4 address (``host`` itself if it is one), ``None`` if none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def address_towards(host: str) -> str | None:
    """The address of this machine's interface that reaches ``host`` (the source
    address of its route; connecting a UDP socket sends nothing), ``None`` if no
    route goes there."""
    target = resolve_ipv4(host)
    if target is None:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def node_address(master_host: str, node_ip: str | None = None) -> str:
    """The address a node's workers listen on and tell their peers in a multi-node
    job: ``--node_ip`` when it is this machine's, else the address of the interface
    that reaches the master (never the hostname's, which Debian's default
    ``/etc/hosts`` maps to 127.0.1.1)."""
    if node_ip is not None and (node_ip in local_addresses() or is_loopback(node_ip)):
        return node_ip
    return address_towards(master_host) or LOOPBACK


def hostname_note(chosen: str) -> str | None:
    """A line for the log when this machine's hostname resolves to a loopback
    address (gloo's default choice) but a multi-node job uses ``chosen``."""
    name = socket.gethostname()
    resolved = resolve_ipv4(name)
    if resolved is None or not is_loopback(resolved) or is_loopback(chosen):
        return None
    return (f"this machine's hostname {name!r} resolves to {resolved} (a loopback address, "
            f"as Debian's default /etc/hosts has it); its workers listen on {chosen}, the "
            "address that reaches the master, instead (--node_ip ADDR picks another)")
