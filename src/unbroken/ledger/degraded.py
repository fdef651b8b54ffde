"""What a degradation cost: the extra step time inside its window (``goodput``'s contract).

A fault that degrades without killing (``slow-rank``, ``network``) records its window: its
``fault_injected`` record carries ``window_s``, and the window is ``[ts, ts + window_s]``.
Training goes on through it, only slower, so the cost is time, not an outage:

- a step is *inside* a window when its interval overlaps it, *outside* when it overlaps none;
- ``step_s_outside``: the median duration of the surviving reference-rank steps outside every
  window (None when there is no window or no such step);
- per fault: ``step_s_inside``, the median duration of the surviving reference-rank steps
  inside its window, and ``degraded_s = max(0, sum of their durations - their number x
  step_s_outside)``: the time its steps took beyond what steps took undegraded;
- the run's ``degraded_s``: the same over the steps inside any window (overlapping windows
  count their steps once).

Pure functions over (begin, end) spans.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

Span = tuple[float, float]


def _inside(steps: Sequence[Span], begins: Sequence[float], window: Span) -> list[int]:
    """Indices of the steps (sorted by begin) whose interval overlaps ``window``."""
    start, end = window
    hi = bisect.bisect_left(begins, end)
    return [i for i in range(hi) if steps[i][1] > start]


def _extra(durations: list[float], typical: float | None) -> float | None:
    if typical is None:
        return None
    return max(0.0, sum(durations) - len(durations) * typical)


def cost(
    steps: Sequence[Span], windows: Sequence[Span]
) -> tuple[float | None, list[tuple[float | None, float | None]], float]:
    """``(step_s_outside, [(step_s_inside, degraded_s) per window], degraded_s of the run)``
    for the surviving reference-rank ``steps`` and the degradation ``windows``."""
    if not windows:
        return None, [], 0.0
    steps = sorted(steps)
    begins = [s for s, _ in steps]
    hit = [_inside(steps, begins, w) for w in windows]
    anywhere = set().union(*hit)
    outside = [e - s for i, (s, e) in enumerate(steps) if i not in anywhere]
    typical = statistics.median(outside) if outside else None
    per: list[tuple[float | None, float | None]] = []
    for idx in hit:
        durs = [steps[i][1] - steps[i][0] for i in idx]
        per.append((statistics.median(durs) if durs else None, _extra(durs, typical)))
    total = _extra([steps[i][1] - steps[i][0] for i in sorted(anywhere)], typical)
    return typical, per, total or 0.0
