"""``BusyClock``: how long the calling thread ran or waited to run, for each step record.

A step record's ``busy_s`` is the training thread's on-CPU time plus its run-queue wait over the
step's interval (``/proc/thread-self/schedstat``, fields 1 and 2, nanoseconds). A rank that
waits for its peers in a collective sleeps, which is not busy; a rank whose CPU is throttled
(a cgroup quota: what thermal throttling looks like) waits for its quota in the run queue,
which is. So in synchronous training, where every rank's step takes equally long, the
straggler's ``busy_s / dur_s`` is near 1 and the others' lower (``stragglers``).

``proc_sent_bytes`` reads another /proc figure of the same kind: the bytes a process passed
to write calls (``wchar``), which tells a collective crawling over a degraded network (its data
trickles out) from a hung one (nothing moves): the launcher's and the in-process watchdog's
"slow, not hung" rules use it.

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


class BusyClock:
    """Readings of one thread's run + run-queue time; ``lap()`` gives the time since the last.

    Not thread-safe: one owner thread at a time. A reading on a thread other than the last
    reading's starts over (None for that lap), since two threads' times do not subtract.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._thread: tuple[int, int] | None = None
        self._last: int | None = None
        self._broken = False

    def _read(self) -> int | None:
        """Nanoseconds the calling thread ran or waited to run, or None (and the last
        reading forgotten when it was another thread's, or another process's: a fork)."""
        if self._broken:
            return None
        me = (os.getpid(), threading.get_ident())
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
    """Bytes process ``pid`` passed to write calls so far, sockets included (/proc/<pid>/io
    ``wchar``; a collective's sends count, datagrams sent with sendto do not); None when the
    process is gone or /proc cannot say."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
