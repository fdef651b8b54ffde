"""Recovery figures per fault class and per phase, over the faults of one run or of several.

``by_class(faults)`` and ``by_phase(faults)`` group ``FaultRecord``s (``fault_classes`` says
how a fault gets its class and phase) and give each group a ``FaultFigures``. Pass one report's
``faults`` for that run, or the faults of several reports concatenated (the runs of one
benchmark configuration, its ``--repeat`` rounds) for figures over all of them.

Definitions, per group:

- ``faults``: how many; ``recovered``: those after which training resumed (``downtime_s`` not
  None). A non-disruptive fault (slow storage: it stopped nothing) counts as recovered, with
  no recovery time. ``recovery_rate`` = recovered / faults.
- ``recovery_s_p50``/``_p95``/``_max``: over the ``recovery_s`` of the faults that have one;
  a quantile is linear between the two nearest ranks (numpy's default): the q-quantile of
  sorted ``x[0..n-1]`` is ``x[i] + f * (x[i+1] - x[i])`` where ``i + f = q * (n - 1)``.
- ``restarts``: restart rounds that acted on the group's faults (``FaultRecord.restarts``);
  ``failed_restarts``: the rounds that did not bring training back, ``restarts - 1`` per
  recovered fault (never below 0) and ``restarts`` per fault never recovered.
- ``steps_lost``: their sum over the faults that have one; ``steps_lost_max`` and
  ``steps_lost_mean`` (per incident) over those faults.
- ``detection_s_p50``: over the faults detected.

Figures over no value are None. Groups hold only classes and phases that occurred.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.ledger.fault_classes import CLASSES, UNKNOWN_PHASE, phase_order
from unbroken.ledger.fault_records import FaultRecord


@dataclass(frozen=True, kw_only=True)
class FaultFigures:
    """What one group of faults (a class, a phase) cost; see the module docstring."""

    faults: int
    """Faults in the group."""
    recovered: int
    """Faults after which training resumed (non-disruptive ones included)."""
    recovery_rate: float
    """recovered / faults."""
    recovery_s_p50: float | None
    """Median fault-to-every-rank-training time over recovered faults."""
    recovery_s_p95: float | None
    """Its 95th percentile (linear between the nearest ranks)."""
    recovery_s_max: float | None
    """Its maximum."""
    restarts: int
    """Restart rounds that acted on the group's faults."""
    failed_restarts: int
    """Restart rounds that did not bring training back."""
    steps_lost: int
    """Steps rolled back, summed over the faults."""
    steps_lost_max: int | None
    """The most steps one fault rolled back."""
    steps_lost_mean: float | None
    """Steps rolled back per incident."""
    detection_s_p50: float | None
    """Median fault-to-detection time over detected faults."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of ``values``, linear between the nearest ranks; None if
    there are none."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is between 0 and 1, got {q!r}")
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    i = math.floor(pos)
    if i >= len(xs) - 1:
        return float(xs[-1])
    return float(xs[i] + (pos - i) * (xs[i + 1] - xs[i]))


def failed_restarts(f: FaultRecord) -> int:
    """Restart rounds on ``f`` that did not bring training back."""
    recovered = f.downtime_s is not None
    return max(0, f.restarts - 1) if recovered else f.restarts


def figures(faults: Sequence[FaultRecord]) -> FaultFigures:
    """The figures of one group of faults."""
    n = len(faults)
    recovered = sum(1 for f in faults if f.downtime_s is not None)
    recoveries = [f.recovery_s for f in faults if f.recovery_s is not None]
    lost = [f.steps_lost for f in faults if f.steps_lost is not None]
    detections = [f.detection_s for f in faults if f.detection_s is not None]
    return FaultFigures(
        faults=n,
        recovered=recovered,
        recovery_rate=recovered / n if n else 0.0,
        recovery_s_p50=quantile(recoveries, 0.5),
        recovery_s_p95=quantile(recoveries, 0.95),
        recovery_s_max=max(recoveries) if recoveries else None,
        restarts=sum(f.restarts for f in faults),
        failed_restarts=sum(failed_restarts(f) for f in faults),
        steps_lost=sum(lost),
        steps_lost_max=max(lost) if lost else None,
        steps_lost_mean=float(statistics.fmean(lost)) if lost else None,
        detection_s_p50=quantile(detections, 0.5),
    )


def _grouped(
    faults: Iterable[FaultRecord],
    key: Callable[[FaultRecord], str],
    order: Callable[[str], Any],
) -> dict[str, FaultFigures]:
    groups: dict[str, list[FaultRecord]] = {}
    for f in faults:
        groups.setdefault(key(f), []).append(f)
    return {name: figures(groups[name]) for name in sorted(groups, key=order)}


def _class_order(name: str) -> tuple[int, str]:
    return (CLASSES.index(name), "") if name in CLASSES else (len(CLASSES), name)


def by_class(faults: Iterable[FaultRecord]) -> dict[str, FaultFigures]:
    """Figures per fault class, in ``CLASSES`` order (only classes that occurred)."""
    return _grouped(faults, lambda f: f.fault_class, _class_order)


def by_phase(faults: Iterable[FaultRecord]) -> dict[str, FaultFigures]:
    """Figures per phase (``unknown`` for faults without one), in ``phase_order``."""
    return _grouped(faults, lambda f: f.phase or UNKNOWN_PHASE, phase_order)
