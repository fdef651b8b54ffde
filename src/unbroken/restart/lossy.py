"""Loss on this process's TCP connections: what tells a collective stalled by a lossy link from
a hung one when neither writes a byte.

A collective crawling over a degraded network usually writes as it goes (the watchdog's
``sent_bytes`` rule), but not always: a lost segment is resent only after TCP's retransmission
timeout (RTO: 200 ms at least, doubled each time the resent segment is lost too), and while the
sender waits for that timer, and its peer for the data, neither process writes anything. The
kernel's own counters say why (``TCP_INFO``): ``tcpi_total_retrans`` (segments this end resent)
and ``tcpi_rcv_ooopack`` (segments that arrived out of order: one before them was lost) grow on
a lossy link and stay put on a healthy one, where even a hung peer's kernel acknowledges what
it receives. A peer that is gone (its node lost, its link cut) acknowledges nothing: the RTO of
the connection to it backs off again and again (``tcpi_backoff``); from ``UNREACHABLE_BACKOFF``
on, that loss no longer excuses the silence.

Only this process's own sockets are read (``getsockopt`` on its own descriptors, listed from
/proc/self/fd at most every ``relist_s``): a few microseconds a socket. Where ``TCP_INFO`` is
not available (not Linux) every reading is None and the rule is off.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

TCP_INFO = getattr(socket, "TCP_INFO", 11)
_INFO_LEN = 232
_ESTABLISHED = 1
_OFFSETS = {"retransmits": 2, "backoff": 4, "unacked": 24, "total_retrans": 100, "ooopack": 224}
UNREACHABLE_BACKOFF = 3
"""Consecutive RTO back-offs (of a connection with data in flight) from which its peer counts
as unreachable: at 1% loss a segment is lost three times in a row once in a million."""


@dataclass(frozen=True)
class Loss:
    """One reading of the process's established TCP connections."""

    lost: dict[int, int]
    """Per connection (socket inode): segments resent by this end plus segments received out
    of order, since the connection opened."""
    unreachable: bool
    """Some connection with data in flight has backed off ``UNREACHABLE_BACKOFF`` times."""

    def since(self, base: Loss) -> int:
        """Segments lost between ``base`` and this reading (connections opened in between
        count whole; closed ones not at all)."""
        return sum(max(0, n - base.lost.get(inode, 0)) for inode, n in self.lost.items())


def _info(fd: int, inode: int) -> dict[str, int] | None:
    try:
        if os.fstat(fd).st_ino != inode:
            return None  # closed and reused since listed
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, _INFO_LEN)
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor is its owner's: never closed here
    if len(raw) < 104 or raw[0] != _ESTABLISHED:
        return None
    raw = raw.ljust(_INFO_LEN, b"\0")  # an older kernel: no out-of-order count
    return {
        "retransmits": raw[_OFFSETS["retransmits"]],
        "backoff": raw[_OFFSETS["backoff"]],
        **{
            name: struct.unpack_from("=I", raw, _OFFSETS[name])[0]
            for name in ("unacked", "total_retrans", "ooopack")
        },
    }


class OwnConnections:
    """Reads ``Loss`` from the calling process's TCP sockets."""

    def __init__(self, relist_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.relist_s = relist_s
        self._clock = clock
        self._listed_at: float | None = None
        self._sockets: list[tuple[int, int]] = []
        """(descriptor, inode) of each socket when last listed."""
        self._off = TCP_INFO is None or not os.path.isdir("/proc/self/fd")

    def _list(self) -> None:
        found = []
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                found.append((int(name), int(target[8:-1])))
        self._sockets = found

    def loss(self) -> Loss | None:
        """This process's connections now; None where the kernel cannot say."""
        if self._off:
            return None
        now = self._clock()
        if self._listed_at is None or now - self._listed_at >= self.relist_s:
            try:
                self._list()
            except OSError:
                self._off = True
                return None
            self._listed_at = now
        lost: dict[int, int] = {}
        unreachable = False
        for fd, inode in self._sockets:
            info = _info(fd, inode)
            if info is None:
                continue  # not TCP, not established, or closed since listed
            lost[inode] = info["total_retrans"] + info["ooopack"]
            backoff = max(info["backoff"], info["retransmits"])
            if info["unacked"] and backoff >= UNREACHABLE_BACKOFF:
                unreachable = True
        return Loss(lost, unreachable)
