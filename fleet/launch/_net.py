"""Addresses and ports: free ports, "is this port taken", "is this address mine"."""

from __future__ import annotations

import contextlib
import socket

from fleet._errors import FleetConfigError

LOOPBACK = "127.0.0.1"


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


def check_port_free(host: str, port: int, option: str) -> None:
    """Fails before any worker starts if ``host:port`` cannot be listened on."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # REUSEADDR: a port in TIME_WAIT (a previous run) is free; one in LISTEN is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise FleetConfigError(
            f"port {port} on {host or 'all interfaces'} is already in use (or cannot be "
            f"bound: {e.strerror}); the coordinator of process 0 must listen there. Pick a "
            f"free port with {option} host:PORT, or leave {option} out on a single node and "
            "fleet picks one"
        ) from None


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
    with contextlib.suppress(OSError):
        # The address the default route leaves from (connect on UDP sends nothing).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addresses.add(s.getsockname()[0])
    return addresses
