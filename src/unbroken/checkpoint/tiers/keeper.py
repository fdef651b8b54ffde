"""The worker's side of the node agent's memory keeper: hand it an arena, ask for one back.

``unbroken-run`` keeps every worker's staging arena (a memfd) alive in the agent, so that a
worker killed by SIGKILL, a segfault or the OOM killer leaves its snapshots behind for the
next process of the same rank (``unbroken.launcher.keeper`` serves this). One message each
way on a unix seqpacket socket, the fd riding along (SCM_RIGHTS); an address that starts with
"@" is in the abstract namespace (no file to leave behind). Any failure to reach the keeper
means "no keeper": the memory tier then lasts only as long as the process.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)

_TIMEOUT_S = 2.0
_MAX_MSG = 65536  # a reply: the keys of a node's ranks fit


def _address(addr: str) -> str:
    return "\0" + addr[1:] if addr.startswith("@") else addr


def _ask(
    addr: str, msg: dict[str, str], fd: int | None = None
) -> tuple[dict[str, Any], int | None]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(_TIMEOUT_S)
        sock.connect(_address(addr))
        socket.send_fds(sock, [json.dumps(msg).encode()], [] if fd is None else [fd])
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 1, socket.MSG_CMSG_CLOEXEC)
    reply = json.loads(data) if data else {}
    return reply, (fds[0] if fds else None)


def put(addr: str, key: str, fd: int) -> bool:
    """Have the keeper at ``addr`` hold ``fd`` (a dup of it) under ``key``, in place of the one
    it held; False when it could not be reached."""
    try:
        reply, _ = _ask(addr, {"op": "put", "key": key}, fd)
    except (OSError, ValueError) as e:
        logger.warning(
            "memory keeper %s unreachable (%s): snapshots die with this process", addr, e
        )
        return False
    return reply.get("ok") == "yes"


def get(addr: str, key: str) -> int | None:
    """The fd the keeper holds under ``key`` (now this process's to close), or None."""
    try:
        _, fd = _ask(addr, {"op": "get", "key": key})
    except (OSError, ValueError) as e:
        logger.warning("memory keeper %s unreachable: %s", addr, e)
        return None
    return fd


def keys(addr: str, prefix: str) -> list[str]:
    """The keys the keeper at ``addr`` holds that start with ``prefix`` ([] when it could not
    be reached or the reply does not fit a message)."""
    try:
        reply, _ = _ask(addr, {"op": "keys", "key": prefix})
    except (OSError, ValueError) as e:
        logger.warning("memory keeper %s unreachable: %s", addr, e)
        return []
    held = reply.get("keys")
    return [str(k) for k in held] if isinstance(held, list) else []
