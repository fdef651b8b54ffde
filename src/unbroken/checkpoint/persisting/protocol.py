"""Messages between a trainer and its writer process: pickled dicts over a Unix stream socket.

Each message is an 8-byte length, then the pickle; file descriptors (the staging arena's memfd)
ride as SCM_RIGHTS on the length. Both ends trust each other (same user, parent and child).
End of stream means the other side is gone.
"""

from __future__ import annotations

import array
import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
_MAX_FDS = 4


class PeerGone(EOFError):
    """The other end closed the socket (exited or died)."""


def send(sock: socket.socket, msg: dict[str, Any], *, fds: tuple[int, ...] = ()) -> None:
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(payload))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, into: bytearray) -> None:
    view = memoryview(into)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerGone("socket closed")
        got += k


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The next message and the fds that came with it; raises PeerGone at end of stream."""
    header = bytearray(_HEADER.size)
    fds: list[int] = []
    got = 0
    while got < _HEADER.size:
        data, ancdata, _flags, _addr = sock.recvmsg(
            _HEADER.size - got, socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
        )
        if not data:
            raise PeerGone("socket closed")
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
                fds.extend(arr)
        header[got : got + len(data)] = data
        got += len(data)
    (size,) = _HEADER.unpack(header)
    payload = bytearray(size)
    _recv_exact(sock, size, payload)
    return pickle.loads(payload), fds
