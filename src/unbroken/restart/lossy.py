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

Only connections to other hosts count (loopback is no network), and only this process's own
sockets are read (``getsockopt`` on its own descriptors, listed from
/proc/self/fd at most every ``relist_s``), two system calls a socket; the watchdog reads them
at most every ``watchdog.LOSS_SAMPLE_S``. Where ``TCP_INFO`` is not available (not Linux)
every reading is None and the rule is off.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

TCP_INFO = getattr(socket, "TCP_INFO", 11)
_INFO_LEN = 232
_MIN_LEN = 104
"""``struct tcp_info`` up to ``tcpi_total_retrans`` (offset 100); ``tcpi_unacked`` is at 24,
``tcpi_rcv_ooopack`` at 224 (Linux 5.4 and later), the u8 ``tcpi_retransmits`` and
``tcpi_backoff`` at 2 and 4."""
_ESTABLISHED = b"\x01"
_HEAD = struct.Struct("=5B")
_U32 = struct.Struct("=I")
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
        """Segments lost between ``base`` and this reading, on the connections open at both:
        one opened since counts nothing (its count may hold the handshake's resent SYN, a
        loaded listener's, not the network's); a closed one neither."""
        return sum(
            max(0, n - base.lost[inode]) for inode, n in self.lost.items() if inode in base.lost
        )


def _getsockopt() -> Callable[..., int] | None:
    """libc's ``getsockopt``, called on a descriptor without wrapping it in a socket object (a
    ``socket.socket(fileno=...)`` costs three more system calls); None: not available."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).getsockopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint32),
    ]
    fn.restype = ctypes.c_int
    return fn


_GETSOCKOPT = _getsockopt()


def _info(fd: int, inode: int, buf: ctypes.Array[ctypes.c_char]) -> tuple[int, int, int] | None:
    """(segments lost, RTO back-offs, segments in flight) of descriptor ``fd`` if it is still
    socket ``inode`` and an established TCP connection; else None."""
    assert _GETSOCKOPT is not None
    try:
        if os.fstat(fd).st_ino != inode:
            return None  # closed and reused since listed
    except OSError:
        return None
    size = ctypes.c_uint32(_INFO_LEN)
    if _GETSOCKOPT(fd, socket.IPPROTO_TCP, TCP_INFO, buf, ctypes.byref(size)) != 0:
        return None  # not TCP (a Unix socket), or closed meanwhile
    if size.value < _MIN_LEN or buf[0] != _ESTABLISHED:
        return None
    if size.value < _INFO_LEN:  # an older kernel: no out-of-order count
        ctypes.memset(ctypes.addressof(buf) + size.value, 0, _INFO_LEN - size.value)
    _, _, retransmits, _, backoff = _HEAD.unpack_from(buf, 0)  # the state is checked above
    (unacked,) = _U32.unpack_from(buf, 24)
    (resent,) = _U32.unpack_from(buf, 100)
    (out_of_order,) = _U32.unpack_from(buf, 224)
    return resent + out_of_order, max(backoff, retransmits), unacked


def _between_hosts(fd: int) -> bool | None:
    """Whether descriptor ``fd`` is a TCP connection to another host; None: not known yet (not
    connected, or closed meanwhile)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        local, peer = sock.getsockname()[0], sock.getpeername()[0]
    except OSError:
        return None  # a listener, or not connected yet
    finally:
        sock.detach()  # the descriptor is its owner's: never closed here
    try:
        return local != peer and not ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False


class OwnConnections:
    """Reads ``Loss`` from the calling process's TCP sockets."""

    def __init__(self, relist_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.relist_s = relist_s
        self._clock = clock
        self._listed_at: float | None = None
        self._sockets: list[tuple[int, int]] = []
        """(descriptor, inode) of each connection to another host when last listed."""
        self._between_hosts: dict[int, bool] = {}
        """Per socket inode: a TCP connection to another host (loopback and this host's own
        addresses are no network: their counts would hold only a loaded listener's resent
        SYNs)."""
        self._off = _GETSOCKOPT is None or not os.path.isdir("/proc/self/fd")
        self._buf = ctypes.create_string_buffer(_INFO_LEN)

    def _list(self) -> None:
        found = []
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                fd, inode = int(name), int(target[8:-1])
                remote = self._between_hosts.get(inode)
                if remote is None:
                    remote = _between_hosts(fd)
                    if remote is not None:  # None: not connected yet, asked again next time
                        self._between_hosts[inode] = remote
                if remote:
                    found.append((fd, inode))
        self._sockets = found
        listed = {inode for _, inode in found}
        if len(self._between_hosts) > 4 * len(listed) + 64:  # forget closed sockets
            self._between_hosts = {i: r for i, r in self._between_hosts.items() if i in listed}

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
            info = _info(fd, inode, self._buf)
            if info is None:
                continue  # not TCP, not established, or closed since listed
            lost[inode], backoff, in_flight = info
            if in_flight and backoff >= UNREACHABLE_BACKOFF:
                unreachable = True
        return Loss(lost, unreachable)
