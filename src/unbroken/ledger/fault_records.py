"""Fault records: one walk over a run's events opens, detects, attaches restarts to and resumes
every fault, and ``FaultRecord`` says what each cost.

The rules are the "Faults" part of ``goodput``'s contract (its module docstring); ``compute``
there calls ``walk_faults`` and ``fault_record`` and folds the outages into the partition.
``Timeline`` indexes the reference rank's steps and checkpoint loads, built once.
``fault_classes`` gives each fault its class and phase.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from unbroken.ledger.events import (
    CKPT_LOAD,
    FAULT_DETECTED,
    FAULT_INJECTED,
    JOB_END,
    RESTART_BEGIN,
    RESTART_END,
    STEP,
    Event,
)
from unbroken.ledger.fault_classes import STEP_PHASE, fault_class


@dataclass(frozen=True, kw_only=True)
class FaultRecord:
    """One fault, injected or natural, and what it cost."""

    index: int
    """0-based position in the order faults were opened."""
    kind: str | None
    """The injected fault kind, or the detected cause for a natural fault."""
    rank: int
    """Rank the fault hit (for a natural fault: the detection's ``fault_rank`` if given)."""
    step: int | None
    """The plan step of an injected fault; None for a natural one."""
    injected: bool
    """True when a ``fault_injected`` record opened it."""
    fault_ts: float
    """Epoch seconds of the fault."""
    cause: str | None
    """Cause named by the detection, if any."""
    detector: str | None
    """What detected it (heartbeat, exit code, watchdog, ...), if detected."""
    layer: str | None
    """The layer that recovered it (inprocess, launcher, orchestrator), if known."""
    detection_s: float | None
    """Detection ts - fault time; None if never detected."""
    recovery_s: float | None
    """Fault time to the end of the first step on every resuming rank; None if never resumed."""
    downtime_s: float | None
    """Fault time to the begin of the resuming reference-rank step; None if never resumed."""
    steps_lost: int | None
    """Rollback distance in steps; None if never resumed."""
    restore_tier: str | None
    """Tier of the checkpoint load between fault and resume ("disk", "memory", ...), or None."""
    restored_step: int | None
    """Step recorded by that checkpoint load, or None."""
    disruptive: bool = True
    """False for a fault that ended no process (no outage: zero downtime)."""
    ckpt_skips: int | None = None
    """Non-disruptive faults: distinct steps whose save was skipped while it was the latest."""
    phase: str | None = None
    """Where it fired: the injected record's ``phase``, else ``step``; a natural fault's is its
    detection's ``phase``, else None (see ``fault_classes``)."""
    fault_class: str = "other"
    """exception, hang, crash, node, storage, degradation or other (see ``fault_classes``)."""
    restarts: int = 0
    """Distinct restart rounds (``restart_begin``) that acted on it while it was open."""
    window_s: float | None = None
    """A degrading fault's window (slow-rank, network): it lasted [fault_ts, + window_s]."""
    step_s_inside: float | None = None
    """Median surviving reference-rank step overlapping that window (``degraded``)."""
    degraded_s: float | None = None
    """Their time beyond as many undegraded steps (``degraded``); None without a window."""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data (``unbroken report --json``).

        Returns:
            Field name -> value.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> FaultRecord:
        """Read a record back.

        Args:
            obj: What ``to_dict`` gave (keys it does not know are ignored).

        Returns:
            The record.
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in names})


@dataclass
class OpenFault:
    """A fault while the walk builds it."""

    fault_ts: float
    rank: int
    kind: str | None
    step: int | None
    injected: bool
    detection_ts: float | None = None
    cause: str | None = None
    detector: str | None = None
    layer: str | None = None
    last_restart_end: float | None = None
    threshold: float | None = None
    resume_ts: float | None = None
    resume_step: int | None = None
    ended: bool = False
    """Resumed by the job's successful end, not by a step (a fault after the last one)."""
    disruptive: bool = True
    phase: str | None = None
    rounds: set[tuple[Any, ...]] = field(default_factory=set)
    """Restart rounds that acted on it: (layer, round) or (layer, attempt, iteration)."""
    window_s: float | None = None
    detected_rank: int | None = None
    """The rank the recorded detection blamed."""

    def current_threshold(self) -> float:
        parts = [self.fault_ts]
        if self.detection_ts is not None:
            parts.append(self.detection_ts)
        if self.last_restart_end is not None:
            parts.append(self.last_restart_end)
        return max(parts)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


class Timeline:
    """Indexes over the sorted events, built once, answering the per-fault questions."""

    def __init__(
        self, ordered: list[Event], ref: int, folded: Mapping[int, array] | None = None
    ) -> None:
        """``folded``: more ranks' step spans (begin, end, ...), as ``reader.StepDigest``."""
        self.ref_steps = [e for e in ordered if e.kind == STEP and e.rank == ref]
        nums = [opt_int(e.get("step")) for e in self.ref_steps]
        # Survival: the last execution (by ts) of each step number on the reference rank.
        self.last_exec = {num: i for i, num in enumerate(nums) if num is not None}
        self.survives = [num is None or self.last_exec[num] == i for i, num in enumerate(nums)]
        self.ref_step_ts = [float(e.ts) for e in self.ref_steps]
        self.prefix_max_step: list[int] = []
        best = -1
        for num in nums:
            best = best if num is None else max(best, num)
            self.prefix_max_step.append(best)
        # Per rank: step begins, sorted, and the earliest end among steps from there on
        # (arrays: a folded digest brings millions of them).
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for e in ordered:
            if e.kind == STEP:
                by_rank.setdefault(e.rank, []).append((float(e.begin), float(e.ts)))
        folded = folded or {}
        self.rank_begins: dict[int, array] = {}
        self.rank_suffix_min_ts: dict[int, array] = {}
        for rank in sorted(set(by_rank) | set(folded)):  # one rank's tuples at a time
            spans = by_rank.pop(rank, [])
            flat = folded.get(rank)
            if flat is not None:
                spans.extend(zip(flat[0::2], flat[1::2], strict=True))
            spans.sort()
            suffix = array("d", bytes(8 * len(spans)))
            low = float("inf")
            for j in range(len(spans) - 1, -1, -1):
                low = min(low, spans[j][1])
                suffix[j] = low
            self.rank_begins[rank] = array("d", (b for b, _ in spans))
            self.rank_suffix_min_ts[rank] = suffix
        self.ref_loads = [e for e in ordered if e.kind == CKPT_LOAD and e.rank == ref]
        self.ref_load_ts = [float(e.ts) for e in self.ref_loads]

    def recovered_ts(self, threshold: float) -> float:
        """Max over ranks of the end of each rank's first step beginning at/after threshold."""
        ends = []
        for rank, begins in self.rank_begins.items():
            j = bisect.bisect_left(begins, threshold)
            if j < len(begins):
                ends.append(self.rank_suffix_min_ts[rank][j])
        return max(ends)

    def last_step_before(self, ts: float) -> int:
        """Highest step number the reference rank completed at or before ts; -1 if none."""
        k = bisect.bisect_right(self.ref_step_ts, ts) - 1
        return self.prefix_max_step[k] if k >= 0 else -1

    def restore(self, start: float, end: float) -> Event | None:
        """The last reference-rank ckpt_load ending in [start, end]."""
        j = bisect.bisect_right(self.ref_load_ts, end) - 1
        return self.ref_loads[j] if j >= 0 and self.ref_load_ts[j] >= start else None


def fault_record(
    index: int, f: OpenFault, timeline: Timeline, t1: float, skips: int | None = None
) -> FaultRecord:
    if not f.disruptive:
        return FaultRecord(
            index=index,
            kind=f.kind,
            rank=f.rank,
            step=f.step,
            injected=f.injected,
            fault_ts=f.fault_ts,
            cause=None,
            detector=None,
            layer=None,
            detection_s=None,
            recovery_s=None,
            downtime_s=0.0,
            steps_lost=0,
            restore_tier=None,
            restored_step=None,
            disruptive=False,
            ckpt_skips=skips,
            phase=f.phase,
            fault_class=fault_class(f.kind, injected=f.injected),
            window_s=f.window_s,
        )
    recovery_s = downtime_s = None
    steps_lost = None
    if f.resume_ts is not None and f.threshold is not None:
        downtime_s = f.resume_ts - f.fault_ts
        if f.ended:
            recovery_s, steps_lost = downtime_s, 0
        else:
            recovery_s = timeline.recovered_ts(f.threshold) - f.fault_ts
        if f.resume_step is not None:
            # Until the fault is detected, a step already past its collectives still ends on
            # the reference rank (its record a moment after a peer's fault): done, then lost.
            seen = f.fault_ts if f.detection_ts is None else f.detection_ts
            last_before = timeline.last_step_before(seen)
            steps_lost = max(0, last_before + 1 - f.resume_step)
    load = timeline.restore(f.fault_ts, f.resume_ts if f.resume_ts is not None else t1)
    return FaultRecord(
        index=index,
        kind=f.kind,
        rank=f.rank,
        step=f.step,
        injected=f.injected,
        fault_ts=f.fault_ts,
        cause=f.cause,
        detector=f.detector,
        layer=f.layer,
        detection_s=None if f.detection_ts is None else f.detection_ts - f.fault_ts,
        recovery_s=recovery_s,
        downtime_s=downtime_s,
        steps_lost=steps_lost,
        restore_tier=None if load is None else opt_str(load.get("tier")),
        restored_step=None if load is None else opt_int(load.get("step")),
        phase=f.phase,
        fault_class=fault_class(f.kind, injected=f.injected),
        restarts=len(f.rounds),
    )


def skips_after(
    skips: list[tuple[float, Any]], faults: list[OpenFault], i: int, t1: float
) -> int | None:
    """Distinct steps skipped (``skips``: (ts, step), sorted) from non-disruptive fault ``i``
    until the next fault's time (or t1); None for a disruptive fault."""
    if faults[i].disruptive:
        return None
    start = faults[i].fault_ts
    end = min((f.fault_ts for f in faults[i + 1 :] if f.fault_ts > start), default=t1)
    lo = bisect.bisect_left(skips, start, key=lambda x: x[0])
    hi = bisect.bisect_right(skips, end, key=lambda x: x[0])
    return len({step for _, step in skips[lo:hi]})


# Recovery layers, inner to outer: an outer layer's restart supersedes what an inner one tried.
_LAYERS = {"inprocess": 0, "launcher": 1, "orchestrator": 2}


def _outer(layer: str | None, other: Any) -> str | None:
    """The layer that recovered a fault: the outermost of those that acted on it (``other``:
    a record's ``layer``; an unknown one only where none is known)."""
    if other is None:
        return layer
    other = str(other)
    if layer is None or _LAYERS.get(other, -1) > _LAYERS.get(layer, -1):
        return other
    return layer


def restart_round(e: Event) -> tuple[Any, ...]:
    """Which restart round a ``restart_begin`` record is part of: every rank of an in-process
    restart writes one with the same attempt and iteration; every node's launcher agent one
    with the same ``round``."""
    layer = opt_str(e.get("layer"))
    if e.get("round") is not None:
        return (layer, "round", e.get("round"))
    return (layer, e.attempt, e.iteration)


def walk_faults(ordered: list[Event], ref: int) -> list[OpenFault]:
    """Open, detect, attach restarts to and resume faults, in event order."""
    faults: list[OpenFault] = []
    open_: list[OpenFault] = []
    for e in ordered:
        kind = e.kind
        if kind == FAULT_INJECTED:
            f = OpenFault(
                fault_ts=float(e.ts),
                rank=e.rank,
                kind=opt_str(e.get("fault")),
                step=opt_int(e.get("step")),
                injected=True,
                phase=opt_str(e.get("phase")) or STEP_PHASE,
            )
            faults.append(f)
            if e.get("disruptive", True) is False:  # nothing to recover: never opened
                f.disruptive = False
                f.resume_ts = f.threshold = f.fault_ts
                window = e.get("window_s")
                if _finite(window) and window > 0:
                    f.window_s = float(window)
                continue
            open_.append(f)
        elif kind == FAULT_DETECTED:
            ts = float(e.ts)
            target = next((f for f in open_ if f.detection_ts is None and f.fault_ts <= ts), None)
            if target is None and any(f.fault_ts <= ts for f in open_):
                # A further detection inside an outage already detected (a peer's collective
                # failing after the faulty rank raised) belongs to that outage. The one that
                # blames the fault's own rank names its cause, also when a peer's failing
                # collective was seen first (a killed rank's peer raises as its agent reaps it).
                first = next(f for f in open_ if f.fault_ts <= ts)
                blamed = e.get("fault_rank")
                if first.injected and blamed == first.rank != first.detected_rank:
                    first.cause = opt_str(e.get("cause"))
                    first.detector = opt_str(e.get("detector"))
                    first.detected_rank = first.rank
                    first.layer = _outer(first.layer, e.get("layer"))
                continue
            if target is None:
                fault_rank = e.get("fault_rank")
                target = OpenFault(
                    fault_ts=ts,
                    rank=e.rank if fault_rank is None else int(fault_rank),
                    kind=opt_str(e.get("cause")),
                    step=None,
                    injected=False,
                    phase=opt_str(e.get("phase")),
                )
                faults.append(target)
                open_.append(target)
            target.detection_ts = ts
            target.cause = opt_str(e.get("cause"))
            target.detector = opt_str(e.get("detector"))
            blamed = e.get("fault_rank")
            target.detected_rank = e.rank if blamed is None else int(blamed)
            target.layer = _outer(target.layer, e.get("layer"))
        elif kind == RESTART_END and e.get("status") == "stopped":
            # A rank's in-process restart given up for the launcher's (it was stopped): that
            # round did not act on the fault.
            for f in open_:
                f.rounds.discard(restart_round(e))
        elif kind in (RESTART_BEGIN, RESTART_END):
            for f in open_:
                f.layer = _outer(f.layer, e.get("layer"))
                if kind == RESTART_END:
                    f.last_restart_end = float(e.ts)
                else:
                    f.rounds.add(restart_round(e))
        elif kind == JOB_END and e.get("status") == "failed" and e.get("round") is not None:
            # The agent wrote that round's restart_begin as it stopped the workers, then gave
            # up (restart budget, no progress) instead of restarting: no restart was tried.
            for f in open_:
                f.rounds.discard(("launcher", "round", e.get("round")))
        elif kind == JOB_END and e.get("status") == "ok" and open_:
            # The job ended well with faults still open: after its last step (in shutdown),
            # nothing was left to redo; the job's end is their resumption.
            for f in open_:
                f.threshold = f.current_threshold()
                f.resume_ts, f.ended = max(float(e.ts), f.threshold), True
            open_ = []
        elif kind == STEP and e.rank == ref and open_:
            begin = float(e.begin)
            still_open = []
            for f in open_:
                threshold = f.current_threshold()
                if begin >= threshold:
                    f.threshold = threshold
                    f.resume_ts = begin
                    f.resume_step = opt_int(e.get("step"))
                else:
                    still_open.append(f)
            open_ = still_open
    return faults
