"""``BusyClock``: how long the calling thread ran or waited to run, for each step record.

A step record's ``busy_s`` is the training thread's on-CPU time plus its run-queue wait over the
step's interval (``/proc/thread-self/schedstat``, fields 1 and 2, nanoseconds). A rank that
waits for its peers in a collective sleeps, which is not busy; a rank whose CPU is throttled
(a cgroup quota: what thermal throttling looks like) waits for its quota in the run queue,
which is. So in synchronous training, where every rank's step takes equally long, the
straggler's ``busy_s / dur_s`` is near 1 and the others' lower (``stragglers``).

``proc_sent_bytes`` reads other /proc figures of the same kind: the bytes a process passed
to write calls (``wchar``) less those its TCP connections still hold unacknowledged, which
tells a collective crawling over a degraded network (its data trickles out) from a hung one
(nothing moves): the launcher's and the in-process watchdog's "slow, not hung" rules use it;
``proc_tcp_retransmitting``, for data on its way under TCP's retransmission timer while
nothing is written, the launcher's.

The file is opened once per thread and read with one ``pread`` (a few microseconds). Where
it cannot be read (not Linux, no schedstat) every reading is None and no ``busy_s`` is
recorded. Only the recording thread is measured: where other threads do the rank's work
(intra-op thread pools, a GPU the thread waits on, by sleeping or by spinning) the figure
says what that thread did, not what the rank did.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PATH = "/proc/thread-self/schedstat"

_forks = 0
"""Forks this process's line has been through: a reading of another process's thread is no
lap (counted at fork, not asked with ``getpid`` at each reading: a step's code runs cold)."""


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class BusyClock:
    """Readings of one thread's run + run-queue time; ``lap()`` gives the time since the last.

    Not thread-safe: one owner thread at a time. A reading on a thread other than the last
    reading's starts over (None for that lap), since two threads' times do not subtract.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._thread: tuple[int, int] | None = None  # (forks, thread ident) of the reading
        self._last: int | None = None
        self._broken = False

    def _read(self) -> int | None:
        """Nanoseconds the calling thread ran or waited to run, or None (and the last
        reading forgotten when it was another thread's, or another process's: a fork)."""
        if self._broken:
            return None
        me = (_forks, threading.get_ident())
        if me != self._thread:
            self.close()
            try:
                self._fd = os.open(PATH, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._broken = True
                return None
            self._thread = me
        assert self._fd is not None
        try:
            run, wait = os.pread(self._fd, 64, 0).split()[:2]
            return int(run) + int(wait)
        except (OSError, ValueError):
            self._broken = True
            return None

    def reset(self) -> None:
        """Start a lap here (a step boundary that is not a step: a phase's end, a mark)."""
        self._last = self._read()

    def lap(self) -> float | None:
        """Seconds busy since the last ``lap``/``reset`` on this thread (None: not known)."""
        owner = self._thread
        before = self._last
        now = self._read()
        self._last = now
        if before is None or now is None or owner != self._thread:
            return None
        return max(0, now - before) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = self._thread = self._last = None


def proc_sent_bytes(pid: int) -> int | None:
    """Bytes process ``pid`` has sent so far: passed to write calls (/proc/<pid>/io ``wchar``,
    a collective's sends included; datagrams sent with sendto not) less those still queued
    unacknowledged on its TCP connections (``tx_queue``). Over a slow link a collective writes
    a socket buffer's worth at once, then nothing for as long as the link takes to carry it: the
    count grows as the peer acknowledges it, not in lumps. None when the process is gone or
    /proc cannot say."""
    queued = sum(int(f[4].split(":")[0], 16) for f in _tcp_connections(pid) or ())
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1]) - queued  # the queue read first: never under
    except (OSError, ValueError, IndexError):
        return None
    return None


def _tcp_connections(pid: int) -> list[list[str]] | None:
    """The established TCP connections of process ``pid`` (the sockets in /proc/<pid>/fd), each
    its /proc/<pid>/net/tcp{,6} row split: sl local rem st tx:rx tr:when retrnsmt uid timeout
    inode. None when the process is gone."""
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) >= 10 and f[3] == "01" and int(f[9]) in inodes:
                rows.append(f)
    return rows


RETRANSMITTING_MAX = 5
"""Consecutive retransmission timeouts of one segment up to which a connection counts as a lossy
link being waited out; more: its peer is gone."""


def proc_tcp_retransmitting(pid: int) -> bool | None:
    """Whether process ``pid`` waits on the network now: a TCP connection to another host holds
    data unacknowledged under its retransmission timer, with at most ``RETRANSMITTING_MAX``
    timeouts in a row (/proc/<pid>/net/tcp{,6}: ``tx_queue``, ``tr`` 1 and ``retrnsmt``, of
    the sockets in /proc/<pid>/fd). A collective over a slow or lossy link writes nothing while
    its data is on the way or TCP waits out a timeout; a hung peer's kernel still acknowledges
    (and, its buffer full, the timer is the zero-window probe's, ``tr`` 4). None when the
    process is gone or /proc cannot say."""
    rows = _tcp_connections(pid)
    if rows is None:
        return None
    for f in rows:
        local, remote = f[1].rsplit(":", 1)[0], f[2].rsplit(":", 1)[0]
        if local == remote or remote.endswith("7F") or remote.endswith("01000000"):
            continue  # this host, or loopback (127.x.x.x, ::1): no network
        queued, timer, timeouts = int(f[4].split(":")[0], 16), f[5][:2], int(f[6], 16)
        if queued and timer == "01" and timeouts <= RETRANSMITTING_MAX:
            return True
    return False
