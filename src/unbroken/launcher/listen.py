"""Where the agent's listening sockets bind: loopback for a single-node job, the job's own
interface otherwise, every interface only where nothing better is known.

torch's ``TCPStore`` server always listens on every interface (``Socket::listen`` takes a port,
no host). It can, however, adopt a socket that is already listening (``master_listen_fd``): the
agent binds that socket itself, so the stores it hosts (the rendezvous/coordination job store
and each round's worker store) listen where ``bind_address`` says. Nothing here authenticates a
store's clients: torch's stores have no authentication; see the README ("Network exposure").
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

ANY = ""
"""``bind_address``'s answer when only every interface will do (torch's own default)."""
LOOPBACK = "127.0.0.1"


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str | None:
    """The IPv4 address ``host`` resolves to here, or None."""
    if host == "localhost":
        return LOOPBACK
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError, ValueError, IndexError):
        return None


def bind_address(host: str, *, single_node: bool) -> str:
    """Where a server that peers reach as ``host`` listens.

    The address ``host`` resolves to on this machine: loopback for a single-node job with a
    local endpoint, the node's own interface for a multi-node job. ``ANY`` (every interface)
    when ``host`` does not resolve, or resolves to a loopback address in a multi-node job (as
    Debian's ``127.0.1.1`` for the machine's own name: peers reach it by another address).
    """
    addr = resolve(host)
    if addr is None:
        return ANY
    if is_loopback(addr):  # exactly that one (127.0.1.1 is not 127.0.0.1)
        return addr if single_node else ANY
    return addr


def listening_store(
    dist: Any, host: str, port: int, *, bind: str, timeout: timedelta, multi_tenant: bool = False
) -> Any:
    """A ``TCPStore`` server on ``port`` (0: any free one) that clients reach as ``host``,
    listening on ``bind`` only (``ANY``: every interface, torch's default). A ``bind`` this
    machine does not have falls back to every interface, with a warning."""
    if bind != ANY:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRNOTAVAIL:  # in use, denied: as torch's own bind would be
                raise
            logger.warning(
                "this machine has no address %s: the store on port %d listens on every interface",
                bind,
                port,
            )
        else:
            try:
                store = dist.TCPStore(
                    bind,
                    sock.getsockname()[1],
                    None,
                    True,
                    timeout=timeout,
                    wait_for_workers=False,
                    multi_tenant=multi_tenant,
                    master_listen_fd=sock.fileno(),
                )
            except BaseException:
                with contextlib.suppress(OSError):
                    sock.close()
                raise
            sock.detach()  # the store owns the descriptor now
            return store
    return dist.TCPStore(
        host, port, None, True, timeout=timeout, wait_for_workers=False, multi_tenant=multi_tenant
    )


# --- a store client's connection that must not hang -----------------------------------------
def open_fds() -> dict[str, str]:
    """This process's open file descriptors: name under ``/proc/self/fd`` -> what it is."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own, closed by now
                out[name] = os.readlink(f"/proc/self/fd/{name}")
    return out


def fail_when_silent(opened_before: dict[str, str], port: int, timeout_s: float) -> int:
    """Make the TCP connections to ``port`` opened since ``opened_before`` fail, rather than
    hang, when their peer goes silent for ``timeout_s``; returns how many were found.

    A store client whose server vanished without a reset (its pod or node lost with its link)
    waits on a reply that never comes, and torch's ``TCPStore`` has calls that wait without a
    timeout. Keep-alive probes plus ``TCP_USER_TIMEOUT`` let the kernel end such a connection:
    every blocked call then raises, and the agent re-joins the store.
    """
    found = 0
    for name, what in open_fds().items():
        if opened_before.get(name) == what or not what.startswith("socket:"):
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it keeps theirs
        except (OSError, ValueError):
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.getpeername()[1] != port:
                    continue
                whole_s = max(1, int(timeout_s))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, whole_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, whole_s * 1000)
                found += 1
            except OSError:
                continue
    return found
