"""Stragglers: which rank slows a synchronous job down, from its step records' ``busy_s``.

In synchronous training every rank's step takes equally long (the fast ranks wait in the
collective for the slow one), so step time cannot name the straggler. What differs is how the
time was spent (``busy.BusyClock``): the straggler's training thread was busy (on a CPU, or
waiting in the run queue for one, as a throttled process does) for nearly all of its step; a
rank that waited for it slept. So a rank's *busy ratio* over some steps is the sum of their
``busy_s`` over the sum of their ``dur_s``, and:

- ``judge``: among ranks with busy ratios, a rank is a straggler when its ratio is at least
  ``MIN_RATIO`` and exceeds the median of the *other* ranks' ratios by at least ``MARGIN``
  (a job of balanced ranks, all busy, has none; a job of one rank has none);
- ``find``: the run's time from ``t0`` is cut into windows of ``window_s`` (``window_for``:
  ``WINDOW_STEPS`` typical steps, at least ``MIN_WINDOW_S``); a step belongs to the window its
  end falls in; consecutive windows are merged until every rank with steps in them has at
  least ``MIN_STEPS`` (steps slower than a window still get judged); in each such group every
  rank gets its busy ratio and ``judge`` names the stragglers; the groups that name the same
  rank, with at most ``MAX_GAP`` groups in a row between them that do not, make one
  ``Straggler`` episode (the span of its steps in the groups that named it, its ratio over
  them, and the median over those groups of the other ranks' median ratio), reported when at
  least ``MIN_WINDOWS`` groups named it.

Pure functions over ``(end ts, dur_s, busy_s)`` samples, one iterable per rank (read once, so
a digest of millions of steps is never copied; ``samples_of`` makes them from step records): ``goodput.compute`` puts the episodes in the
report, the dashboard judges each rank's latest steps.
"""

from __future__ import annotations

import itertools
import math
import statistics
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.ledger.events import STEP, Event
from unbroken.ledger.reader import StepDigest

MIN_RATIO = 0.4
"""Least busy ratio of a straggler. A throttled rank's training thread is busy for most of each
step, not all of it: it also sleeps while waiting for the rank's own communication thread,
which waits for the same quota (the run queue time goes to that thread, not this one)."""
MARGIN = 0.25
"""Least lead of a straggler's busy ratio over the other ranks' median."""
WINDOW_STEPS = 5
"""Typical steps per window."""
MIN_WINDOW_S = 1.0
"""Shortest window."""
MIN_STEPS = 2
"""Least steps of a rank in a window for its ratio to count."""
MIN_WINDOWS = 2
"""Least windows that name the rank in an episode (a one-window lead is noise: a busy machine)."""
MAX_GAP = 1
"""Windows in a row that may not name the rank inside one episode (noise the other way)."""
CALIBRATION_STEPS = 20
"""The window is sized on the median of this many first steps (so it does not move later)."""

Sample = tuple[float, float, float]
"""One step record: (end ts, dur_s, busy_s)."""


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """One rank named a straggler in consecutive windows."""

    rank: int
    """The straggling rank."""
    begin_ts: float
    """Begin of its first step in those windows (epoch seconds)."""
    end_ts: float
    """End of its last step in them."""
    steps: int
    """Its steps in them."""
    busy_ratio: float
    """Its busy time over its step time in them."""
    others_ratio: float
    """The median over those windows of the other ranks' median busy ratio."""
    windows: int
    """Windows it was named in."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio(busy_s: float, dur_s: float) -> float | None:
    """Busy time over step time (None without step time)."""
    return busy_s / dur_s if dur_s > 0 else None


def judge(
    ratios: Mapping[int, float], *, min_ratio: float = MIN_RATIO, margin: float = MARGIN
) -> list[int]:
    """The stragglers among ranks with these busy ratios (see the module docstring), sorted."""
    out = []
    for rank, r in ratios.items():
        if r < min_ratio:
            continue
        others = [v for k, v in ratios.items() if k != rank]
        if others and r - statistics.median(others) >= margin:
            out.append(rank)
    return sorted(out)


def window_for(durations: Iterable[float]) -> float:
    """The window length for steps of these durations (the first ``CALIBRATION_STEPS``
    count): ``WINDOW_STEPS`` x their median, at least ``MIN_WINDOW_S``."""
    first = [d for _, d in zip(range(CALIBRATION_STEPS), durations, strict=False) if d > 0]
    typical = statistics.median(first) if first else 0.0
    return max(MIN_WINDOW_S, WINDOW_STEPS * typical)


class _Sums:
    """One rank's busy and step seconds, step count, first begin and last end per window."""

    def __init__(self, n: int) -> None:
        self.busy = array("d", bytes(8 * n))
        self.dur = array("d", bytes(8 * n))
        self.count = array("l", bytes(array("l").itemsize * n))
        self.begin = array("d", [math.inf]) * n
        self.end = array("d", [-math.inf]) * n


def find(
    samples: Mapping[int, Iterable[Sample]], *, t0: float, t1: float, window_s: float
) -> list[Straggler]:
    """Straggler episodes of samples in [t0, t1] (see the module docstring), by begin."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    n = max(1, math.floor((t1 - t0) / window_s) + 1)
    sums: dict[int, _Sums] = {}
    for rank, rows in samples.items():
        s: _Sums | None = None
        for end, dur, busy in rows:
            if not (dur > 0 and busy >= 0 and t0 <= end <= t1):  # NaN busy: not measured
                continue
            if s is None:
                s = sums[rank] = _Sums(n)
            k = min(n - 1, int((end - t0) / window_s))
            s.busy[k] += busy
            s.dur[k] += dur
            s.count[k] += 1
            s.begin[k] = min(s.begin[k], end - dur)
            s.end[k] = max(s.end[k], end)
    if len(sums) < 2:
        return []
    out: list[Straggler] = []
    open_: dict[int, _Episode] = {}
    for group in _groups(sums, n):
        ratios = {r: b / d for r, (b, d, c, _, _) in group.items() if c >= MIN_STEPS and d > 0}
        named = set(judge(ratios))
        for rank in named:
            ep = open_.setdefault(rank, _Episode())
            ep.add(group[rank], statistics.median(v for r, v in ratios.items() if r != rank))
        for rank in [r for r in open_ if r not in named]:
            open_[rank].missed += 1
            if open_[rank].missed > MAX_GAP:
                out.append(open_.pop(rank).straggler(rank))
    out += [ep.straggler(rank) for rank, ep in open_.items()]
    return sorted((e for e in out if e.windows >= MIN_WINDOWS), key=lambda e: (e.begin_ts, e.rank))


_Group = dict[int, tuple[float, float, int, float, float]]
"""rank -> (busy s, step s, steps, first begin, last end) over some consecutive windows."""


def _groups(sums: Mapping[int, _Sums], n: int) -> Iterable[_Group]:
    """Consecutive windows merged until every rank with steps in them has ``MIN_STEPS`` (steps
    slower than a window would otherwise leave every window unjudged)."""
    acc: dict[int, list[float]] = {}
    for k in range(n):
        for rank, s in sums.items():
            if s.count[k]:
                a = acc.setdefault(rank, [0.0, 0.0, 0, math.inf, -math.inf])
                a[0] += s.busy[k]
                a[1] += s.dur[k]
                a[2] += s.count[k]
                a[3] = min(a[3], s.begin[k])
                a[4] = max(a[4], s.end[k])
        if acc and all(a[2] >= MIN_STEPS for a in acc.values()):
            yield {r: (a[0], a[1], int(a[2]), a[3], a[4]) for r, a in acc.items()}
            acc = {}
    if acc:
        yield {r: (a[0], a[1], int(a[2]), a[3], a[4]) for r, a in acc.items()}


class _Episode:
    """A straggler episode while ``find`` builds it."""

    def __init__(self) -> None:
        self.busy = self.dur = 0.0
        self.steps = 0
        self.begin, self.end = math.inf, -math.inf
        self.others: list[float] = []
        self.missed = 0
        """Groups since the last one that named the rank."""

    def add(self, sums: tuple[float, float, int, float, float], others: float) -> None:
        self.missed = 0
        busy, dur, steps, begin, end = sums
        self.busy += busy
        self.dur += dur
        self.steps += steps
        self.begin, self.end = min(self.begin, begin), max(self.end, end)
        self.others.append(others)

    def straggler(self, rank: int) -> Straggler:
        return Straggler(
            rank=rank,
            begin_ts=self.begin,
            end_ts=self.end,
            steps=self.steps,
            busy_ratio=self.busy / self.dur,
            others_ratio=float(statistics.median(self.others)),
            windows=len(self.others),
        )


def samples_of(
    ordered: Sequence[Event], folded: StepDigest | None = None
) -> dict[int, Iterable[Sample]]:
    """Per rank, its step records' (end, dur_s, busy_s), from the events and the digest."""
    out: dict[int, list[Sample]] = {}
    for e in ordered:
        busy = e.get("busy_s") if e.kind == STEP else None
        if busy is not None and e.dur_s is not None and e.rank >= 0:
            out.setdefault(e.rank, []).append((float(e.ts), e.dur_s, float(busy)))
    samples: dict[int, Iterable[Sample]] = dict(out)
    for rank, busy in (folded.busy if folded is not None else {}).items():
        spans = folded.spans[rank]  # type: ignore[union-attr]
        digest = zip(spans[0::2], spans[1::2], busy, strict=True)
        more = ((end, end - begin, b) for begin, end, b in digest)
        samples[rank] = itertools.chain(out.get(rank, ()), more)
    return samples
