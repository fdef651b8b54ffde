"""The memory keeper: the node agent holds its workers' staging arenas across their deaths.

A worker hands the keeper its arena's memfd when it allocates one (``put``, keyed by checkpoint
directory and rank); the next process of that rank asks for it (``get``) and restores its newest
snapshot from memory instead of disk (``unbroken.checkpoint.staging.memory``); ``keys`` lists the keys
held under a prefix (a restarted worker looks at its node's other ranks). The keeper never maps
the memory: it only holds the descriptors, closes the one a ``put`` replaces, and closes all
at the end of the job. memfds have no name, so nothing is left in /dev/shm whatever happens to
the agent: a SIGKILLed agent's descriptors close with it and the kernel frees the memory.

The socket is a unix seqpacket socket in the abstract namespace (no file either, but reachable
by any process of the network namespace: requests from another user, by SO_PEERCRED, are
refused), served by one thread; the protocol is ``unbroken.checkpoint.tiers.keeper``'s (one JSON message each way, the fd as
SCM_RIGHTS).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import threading

logger = logging.getLogger(__name__)

_MAX_MSG = 4096
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class MemoryKeeper:
    """Holds memfds for the workers of this node; ``addr`` goes into their environment."""

    def __init__(self) -> None:
        name = f"unbroken-keeper-{os.getpid()}-{secrets.token_hex(4)}"
        self.addr = "@" + name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind("\0" + name)
        self._sock.listen(16)
        self._held: dict[str, int] = {}
        self._touched: dict[str, int] = {}
        """Key -> the last round it was put or asked for."""
        self._round = 0
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0
        """Requests refused because they came from another user's process."""
        self._thread = threading.Thread(target=self._serve, name="unbroken-keeper", daemon=True)
        self._thread.start()

    def begin_round(self, round_: int) -> None:
        """A new round: arenas neither put nor asked for in this or the previous round are
        let go (their ranks moved to other nodes, which fetched them in that round)."""
        with self._lock:
            self._round = round_
            old = [k for k, r in self._touched.items() if r < round_ - 1]
            fds = [self._held.pop(k) for k in old if k in self._held]
            for k in old:
                del self._touched[k]
        for fd in fds:
            os.close(fd)

    def dup(self, key: str) -> int | None:
        """A duplicate of the descriptor held under ``key`` (the caller's to close), or None:
        what the node's peer service serves to other nodes."""
        with self._lock:
            fd = self._held.get(key)
            return os.dup(fd) if fd is not None else None

    def held(self) -> dict[str, int]:
        """Key -> bytes of every arena held now."""
        with self._lock:
            return {k: os.fstat(fd).st_size for k, fd in self._held.items()}

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(2.0)
                try:
                    _, uid, _ = _CRED.unpack(
                        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
                    )
                    if uid != os.getuid():  # an abstract socket: any user of the netns
                        self.refused += 1
                        logger.warning("memory keeper: refused a request of uid %d", uid)
                        continue
                    self._answer(conn)
                except (OSError, ValueError) as e:
                    logger.warning("memory keeper: a bad request: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MSG, 1, socket.MSG_CMSG_CLOEXEC)
        try:
            msg = json.loads(data)
            op, key = msg["op"], str(msg["key"])
        except (ValueError, KeyError, TypeError):
            for fd in fds:
                os.close(fd)
            raise ValueError(f"malformed message {data[:100]!r}") from None
        if op == "put" and fds:
            with self._lock:
                old = self._held.pop(key, None)
                if self._closed:
                    os.close(fds[0])
                else:
                    self._held[key] = fds[0]
                    self._touched[key] = self._round
            if old is not None:
                os.close(old)
            socket.send_fds(conn, [b'{"ok": "yes"}'], [])
        elif op == "get":
            with self._lock:
                mine = self._held.get(key)
                dup = os.dup(mine) if mine is not None else None
                if mine is not None:
                    self._touched[key] = self._round
            try:
                socket.send_fds(conn, [b'{"ok": "yes"}'], [] if dup is None else [dup])
            finally:
                if dup is not None:
                    os.close(dup)
        elif op == "keys":  # the keys it holds that start with ``key``
            with self._lock:
                held = sorted(k for k in self._held if k.startswith(key))
            socket.send_fds(conn, [json.dumps({"ok": "yes", "keys": held}).encode()], [])
        else:
            for fd in fds:
                os.close(fd)
            socket.send_fds(conn, [b'{"ok": "no"}'], [])

    def close(self) -> None:
        """Stop serving and let go of every arena (the end of the job). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held, self._held = self._held, {}
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5.0)
        for fd in held.values():
            os.close(fd)
