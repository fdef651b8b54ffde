"""Slow, not hung: what tells the agent that a silent worker is still working.

A worker that sends no heartbeat within its timeout is a *suspect* (``monitor``); before it is
called hung, the agent asks /proc whether it is working:

- a silent worker that is computing is slow, not hung: when a deadline passes and some
  suspect of the node (a worker late, or within half a timeout of it) was runnable for at least
  ``BUSY_CORES`` of the time since it became one (``proc_runnable_s``: the time its threads
  ran or waited to run, /proc's schedstat), every suspect gets one more timeout, up to
  ``BUSY_LIMIT`` timeouts of silence (a loop that spins is a hang too). A hung rank sleeps or
  waits (a collective whose peer never comes, a lock), and so does every rank waiting on it; a
  busy machine's slow step computes. That time is measured from the half-timeout mark, not the
  heartbeat: the end of the step that sent it (a snapshot's copy, the next batch) is work, not
  progress;
- a silent worker that is sending is slow, not hung either: a collective over a degraded
  network (delay, loss) sleeps in the kernel while its data trickles out. When some suspect
  wrote at least ``SENDING_BYTES_S`` bytes a second since it became one (``sent_bytes``: the
  bytes its write calls passed to the kernel, sockets included: ``proc_sent_bytes``), every
  suspect gets one more timeout, up to ``SENDING_LIMIT`` timeouts of silence. A hung collective
  sends nothing: its peer never takes the data (or never sent its own). Nor does a collective
  while TCP waits out a retransmission timeout on a lossy link: a suspect with a connection to
  another host in that state (``retransmitting``: ``proc_tcp_retransmitting``) is given time
  the same way; a hung peer's kernel still acknowledges, a lost one's never does;
- a silent worker whose own in-process watchdog says it waits on a slow network (``vouched``:
  its ``client.waiting`` datagram, sent while the watchdog sees its collective's bytes
  acknowledged or its lost segments resent) is given time the same way: a receiver on a lossy
  link writes nothing and holds no data under a retransmission timer, so /proc shows the
  agent nothing, while the worker's own connections (``TCP_INFO``) show the link at work.

Each limit keeps a worker that works without progressing (a loop that spins, a link that
never delivers a step) from being given time for ever.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

BUSY_CORES = 0.3
"""Time a silent worker's threads ran or waited for a CPU (run queue), per second, above which it
is computing. A hung worker sleeps or waits: near 0 (only its heartbeat and monitor threads
run); a computing one is runnable all the time, near 1 however busy the machine (on an
oversubscribed one it waits for a CPU much of that time), where its CPU time alone falls far
below 1."""
BUSY_LIMIT = 4.0
"""Timeouts of silence a computing worker is given at most."""
SENDING_BYTES_S = 4096.0
"""Bytes a second a silent worker writes, above which it is communicating (a hung one writes
none: its heartbeats are datagrams, which this does not count, and it records no steps)."""
SENDING_LIMIT = 30.0
"""Timeouts of silence a communicating worker is given at most (a link 50 ms longer each way
that loses 1% of its packets carries ~180 KB/s per TCP connection: a step of some MB takes the
whole of a 20 s degradation)."""

VOUCH_FRESH = 2.0
"""Heartbeat intervals a worker's ``waiting`` word holds for (it is repeated twice an interval
while the worker waits)."""

RunClock = Callable[[int], "float | None"]
"""Seconds a process's threads have run or waited to run, None when it cannot be read."""
ByteCount = Callable[[int], "int | None"]
"""Bytes a process has written (to files, pipes, sockets), None when it cannot be read."""


def proc_runnable_s(pid: int) -> float | None:
    """Seconds the live threads of process ``pid`` have spent on a CPU or in its run queue
    (/proc/<pid>/task/*/schedstat); None when the process is gone or /proc cannot say."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            run, wait = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
            total += int(run) + int(wait)
        except (OSError, ValueError):
            continue  # a thread that just ended
    return total / 1e9 if tids else None


class Suspect(Protocol):
    """What the rules read of a suspect (``monitor.Hang``)."""

    @property
    def rank(self) -> int: ...
    @property
    def silent_s(self) -> float: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def runnable(self) -> float | None: ...
    @property
    def sending(self) -> float | None: ...
    @property
    def retransmitting(self) -> bool | None: ...
    @property
    def vouched(self) -> str | None: ...


def slow_not_hung(suspects: Sequence[Suspect]) -> tuple[str | None, float]:
    """(why the suspects are slow, not hung, and how many timeouts of silence that allows them
    at most) or (None, 0.0): they are hung."""

    def within(limit: float) -> bool:
        return not any(h.silent_s >= limit * h.timeout_s for h in suspects)

    for h in suspects:
        if h.runnable is not None and h.runnable >= BUSY_CORES and within(BUSY_LIMIT):
            return (
                f"rank {h.rank} is computing (it ran or waited to run {h.runnable:.2f} "
                "of the time)",
                BUSY_LIMIT,
            )
    for h in suspects:
        if h.sending is not None and h.sending >= SENDING_BYTES_S and within(SENDING_LIMIT):
            return (
                f"rank {h.rank} is sending ({h.sending / 1e3:.1f} kB/s: a collective over "
                "a slow network)",
                SENDING_LIMIT,
            )
    for h in suspects:
        if h.retransmitting and within(SENDING_LIMIT):
            return (
                f"rank {h.rank} waits out a TCP retransmission timeout (a collective over a "
                "lossy link)",
                SENDING_LIMIT,
            )
    for h in suspects:
        if h.vouched and within(SENDING_LIMIT):
            return f"rank {h.rank}'s watchdog: {h.vouched}", SENDING_LIMIT
    return None, 0.0
