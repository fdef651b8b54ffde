"""Ports a process hands to another before anyone listens on them.

A port that ``bind(0)`` returns comes from the kernel's ephemeral range: once the socket that
found it closes, any outgoing connection on the host may take it before the process it was meant
for binds it (``EADDRINUSE`` at the store, a job that fails to start). :func:`spare_port` picks
from below that range instead, where only an explicit ``bind`` takes a port. Imports of ours:
none.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this lie well-known and registered services
_TRIES = 200


def ephemeral_range() -> tuple[int, int] | None:
    """The host's ephemeral port range, ``(low, high)``; ``None`` where it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        lo, hi = _RANGE_FILE.read_text().split()
        return int(lo), int(hi)
    return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def spare_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and outside the ephemeral range.

    Args:
        host: the address the port will be bound on.

    Returns:
        The port. Where the ephemeral range leaves no room below it (or cannot be read), a
        port from ``bind(0)``, as before.
    """
    eph = ephemeral_range()
    if eph is not None and eph[0] - 1 > _LOWEST:
        rng = random.Random()
        for _ in range(_TRIES):
            port = rng.randint(_LOWEST, eph[0] - 1)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
