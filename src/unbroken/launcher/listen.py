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
