"""Goodput math: from a run's events to one ``RunReport``. This docstring is the contract.

Input is any sequence of ``Event`` from any number of processes, in any order; it is sorted by
``(ts, kind, rank, attempt, iteration)`` first. An interval record (one with ``dur_s``) covers
``[ts - dur_s, ts]``; ``Event.begin`` is its start. ``alert`` records are dropped first: they
describe the run, they are not part of it (a watcher may write one after the job ended). Empty
input (after that) raises ``ValueError``.

Time span
    ``t0`` = min over all events of ``begin``; ``t1`` = max ``ts``; ``wall_s = t1 - t0``.

Reference timeline
    ``step``, ``phase``, ``ckpt_stage`` and ``ckpt_load`` records are taken from the reference
    rank only (``reference_rank``, default 0, in every attempt and iteration). Fault records
    (``fault_injected``, ``fault_detected``, ``restart_begin``/``restart_end``, ``worker_exit``)
    are taken from every rank, the launcher (rank -1) included; ``worker_exit``, ``escalate``
    and the ``ckpt_persist``/``commit`` records inform no figure beyond ``t0``/``t1``.

Steps
    A ``step`` record carries ``step`` (the step number) and ``dur_s``. One step number may be
    executed several times (after a rollback). An execution *survives* when no later execution
    (by ``ts``) of the same number exists on the reference rank; earlier ones are re-executed
    work. ``steps_completed`` = number of distinct step numbers with a surviving execution.
    A step record without a step number counts as surviving but not as a completed step.

Faults (one walk over the events in order)
    * ``fault_injected`` opens a fault: time = its ``ts``, rank = its rank, kind = ``fault``,
      step = ``step``, injected. One with ``disruptive: false`` (a fault that ends no process,
      e.g. slow storage) is recorded but never opened: zero downtime (``downtime_s`` = 0,
      ``steps_lost`` = 0, ``recovery_s`` and ``detection_s`` None), no detection or restart
      attaches to it; its effect is ``ckpt_skips``: the distinct steps whose save was skipped
      (``ckpt_skip`` on any rank) from its time until the next fault's (or ``t1``).
    * ``fault_detected`` attaches to the oldest open fault without a detection whose time is
      <= its ``ts``; if every open fault is already detected, it is a secondary detection of
      that outage (a peer's collective failing after the faulty rank raised) and is ignored;
      if no fault is open, it opens a *natural* fault at its own ``ts`` (kind = ``cause``,
      rank = ``fault_rank`` or else the record's rank, step None, not injected). It sets
      ``cause``, ``detector`` and ``layer`` (``layer`` only when given).
    * ``restart_begin``/``restart_end`` set ``layer`` on every open fault that has none;
      ``restart_end`` also records its ``ts`` on every open fault.
    * A fault's threshold is max(fault time, detection ts, last attached ``restart_end`` ts).
      A reference-rank ``step`` record whose ``begin`` >= the threshold *resumes* (and closes)
      every open fault it satisfies: ``resume_ts`` = that ``begin``. The walk meets a step
      record at its ``ts`` (its end), so only records up to then count toward the threshold.
    * ``recovered_ts``: for every rank with a ``step`` record whose ``begin`` >= the threshold,
      the ``ts`` of its first such record; the max over those ranks.
    * ``restore_tier``/``restored_step``: ``tier``/``step`` of the last reference-rank
      ``ckpt_load`` whose ``ts`` lies in [fault time, resume_ts] ([fault time, t1] when not
      resumed); None when there is none.
    * ``detection_s`` = detection ts - fault time (None without detection);
      ``downtime_s`` = resume_ts - fault time; ``recovery_s`` = recovered_ts - fault time;
      ``steps_lost`` = max(0, last_step_before + 1 - first_step_after), where last_step_before
      is the highest step number of a reference-rank step record with ``ts`` <= fault time
      (-1 if none) and first_step_after is the number of the resuming step. The last three
      are None when the fault never resumed.

Partition of [t0, t1]
    Each category below is a set of intervals; every elementary piece of [t0, t1] is assigned
    to the highest-priority category that covers it (a sweep over sorted boundaries), the rest
    to ``other``. Highest priority first:

    1. ``checkpoint_save``: reference-rank ``ckpt_stage`` intervals (the trainer was blocked).
    2. ``checkpoint_load``: reference-rank ``ckpt_load`` intervals (and phase ``ckpt_load``).
    3. phases, by name, in this order: ``startup`` (phase ``import``), ``rendezvous``,
       ``pg_init``, ``model_build``, ``data``, ``shutdown``. Other phase names are ignored.
       The launcher's (rank ``LAUNCHER_RANK``) phases, up to the begin of the reference
       rank's first record, count as ``startup`` (its start-up, rendezvous and launch).
    4. ``productive``: surviving step intervals.
    5. ``reexecuted``: step intervals that were later rolled back.
    6. ``detection``: per fault, [fault time, detection ts].
    7. ``recovery``: per fault, [detection ts (fault time without one), resume_ts], or up to
       ``t1`` for a fault that never resumed.
    8. ``other``: everything not covered (e.g. background ``ckpt_persist`` waits, exits).

    ``productive_s`` = time assigned to ``productive``; ``badput_s`` maps every other category
    (always all keys) to its seconds. ``productive_s + sum(badput_s.values()) == wall_s``.

Figures
    * ``training_goodput = productive_s / wall_s`` (0.0 when ``wall_s == 0``).
    * ``infra_goodput = 1 - |union over faults of [detection ts, resume_ts or t1]| / wall_s``
      (1.0 when ``wall_s == 0``; fault time stands in for a fault never detected). This is the
      published definition, 1 - (shutdown + startup time per fault) / wall time: the time the
      infrastructure spent tearing down and bringing back. The time a fault went unnoticed is
      not in it; it is ``detection`` badput and in ``availability``.
    * ``availability = 1 - |union over faults of [fault time, resume_ts or t1]| / wall_s``:
      the stricter figure, detection included.
    * ``checkpoint_save_s`` = time assigned to ``checkpoint_save``; ``loop_s`` = measure of the
      union of all reference-rank step intervals (surviving and re-executed) and ``ckpt_stage``
      intervals; ``checkpoint_efficiency = 1 - checkpoint_save_s / loop_s`` (None if
      ``loop_s == 0``).
    * ``ettr = productive_s / (wall_s - startup_first_s)``, where ``startup_first_s`` is the
      time assigned to ``startup`` before the ``begin`` of the first reference-rank step record
      (before ``t1`` if there is none); None when the denominator is 0.
    * ``run``: the most common non-empty ``run`` field (ties: smallest; "" if none).
      ``num_attempts``: distinct ``attempt`` values; ``num_iterations``: max ``iteration`` + 1.
    * ``step_time_s_median``: median ``dur_s`` of surviving steps (None if none);
      ``recovery_s_median``/``recovery_s_max``: over faults with a ``recovery_s`` (else None).

Cost: O(n log n) in the number of events.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.ledger.events import (
    ALERT,
    CKPT_COMMIT,
    CKPT_FAIL,
    CKPT_LOAD,
    CKPT_PERSIST,
    CKPT_SKIP,
    CKPT_STAGE,
    ESCALATE,
    FAULT_DETECTED,
    FAULT_INJECTED,
    JOB_END,
    LAUNCHER_RANK,
    PHASE,
    PROCESS_START,
    RESTART_BEGIN,
    RESTART_END,
    STEP,
    WORKER_EXIT,
    Event,
)

# Partition categories in priority order, highest first ("other" is implicit, lowest).
CATEGORIES = (
    "checkpoint_save",
    "checkpoint_load",
    "startup",
    "rendezvous",
    "pg_init",
    "model_build",
    "data",
    "shutdown",
    "productive",
    "reexecuted",
    "detection",
    "recovery",
)
OTHER = "other"
BADPUT_CATEGORIES = tuple(c for c in CATEGORIES if c != "productive") + (OTHER,)

_PRIO = {name: i for i, name in enumerate(CATEGORIES)}
_PHASE_CATEGORY = {
    "import": "startup",
    "rendezvous": "rendezvous",
    "pg_init": "pg_init",
    "model_build": "model_build",
    "data": "data",
    "shutdown": "shutdown",
    "ckpt_load": "checkpoint_load",
}
# Tie-break for records with equal ts: intervals that end there first, then a fault's injection
# before its detection, and a restart's begin before its end.
_KIND_ORDER = {
    kind: i
    for i, kind in enumerate(
        (
            PROCESS_START,
            PHASE,
            STEP,
            CKPT_STAGE,
            CKPT_LOAD,
            CKPT_PERSIST,
            CKPT_COMMIT,
            CKPT_SKIP,
            CKPT_FAIL,
            FAULT_INJECTED,
            FAULT_DETECTED,
            WORKER_EXIT,
            RESTART_BEGIN,
            RESTART_END,
            ESCALATE,
            JOB_END,
        )
    )
}


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """Every figure of one run; see the module docstring for the definitions."""

    run: str
    """The run id (most common ``run`` field)."""
    wall_s: float
    """t1 - t0."""
    productive_s: float
    """Seconds of surviving steps not covered by a higher-priority category."""
    steps_completed: int
    """Distinct step numbers with a surviving execution."""
    training_goodput: float
    """productive_s / wall_s."""
    infra_goodput: float
    """1 - union of [detection, resume] per fault / wall_s (shutdown + startup)."""
    availability: float
    """1 - union of [fault, resume] per fault / wall_s (detection included)."""
    checkpoint_efficiency: float | None
    """1 - checkpoint_save_s / loop_s; None if there is no loop time."""
    ettr: float | None
    """productive_s / (wall_s - first-launch startup); None if that is 0."""
    badput_s: dict[str, float]
    """Seconds per non-productive category (all of BADPUT_CATEGORIES)."""
    faults: list[FaultRecord]
    """Faults in the order they were opened."""
    num_attempts: int
    """Distinct launcher attempts seen."""
    num_iterations: int
    """Max in-process iteration + 1."""
    checkpoint_save_s: float
    """Seconds the trainer was blocked by saves."""
    loop_s: float
    """Measure of the union of reference-rank step and ckpt_stage intervals."""
    step_time_s_median: float | None
    """Median duration of surviving steps."""
    recovery_s_median: float | None
    """Median recovery_s over recovered faults."""
    recovery_s_max: float | None
    """Max recovery_s over recovered faults."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["faults"] = [f.to_dict() for f in self.faults]
        out["badput_s"] = {k: float(v) for k, v in self.badput_s.items()}
        return out


@dataclass
class _Fault:
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
    disruptive: bool = True

    def current_threshold(self) -> float:
        parts = [self.fault_ts]
        if self.detection_ts is not None:
            parts.append(self.detection_ts)
        if self.last_restart_end is not None:
            parts.append(self.last_restart_end)
        return max(parts)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _sort_key(e: Event) -> tuple[float, int, int, int, int]:
    return (float(e.ts), _KIND_ORDER.get(e.kind, 0), e.rank, e.attempt, e.iteration)


def _union_measure(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    cur_s: float | None = None
    cur_e = 0.0
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if cur_s is None or s > cur_e:
            if cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_s is not None:
        total += cur_e - cur_s
    return total


def _partition(
    intervals: list[tuple[float, float, int]], t0: float, t1: float, startup_cutoff: float
) -> tuple[list[float], float]:
    """Sweep: seconds per priority (last slot: other), and startup seconds before the cutoff."""
    n = len(CATEGORIES)
    points: list[tuple[float, int, int]] = []
    for s, e, prio in intervals:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            points.append((s, 1, prio))
            points.append((e, -1, prio))
    points.sort()
    counts = [0] * n
    totals = [0.0] * (n + 1)
    startup = _PRIO["startup"]
    startup_before = 0.0
    prev = t0
    for pos, delta, prio in points:
        if pos > prev:
            cat = n
            for i in range(n):
                if counts[i]:
                    cat = i
                    break
            totals[cat] += pos - prev
            if cat == startup and prev < startup_cutoff:
                startup_before += min(pos, startup_cutoff) - prev
            prev = pos
        counts[prio] += delta
    assert not any(counts), "unbalanced interval boundaries"
    if t1 > prev:
        totals[n] += t1 - prev
    return totals, startup_before


class _Timeline:
    """Indexes over the sorted events, built once, answering the per-fault questions."""

    def __init__(self, ordered: list[Event], ref: int) -> None:
        self.ref_steps = [e for e in ordered if e.kind == STEP and e.rank == ref]
        nums = [_opt_int(e.get("step")) for e in self.ref_steps]
        # Survival: the last execution (by ts) of each step number on the reference rank.
        self.last_exec = {num: i for i, num in enumerate(nums) if num is not None}
        self.survives = [num is None or self.last_exec[num] == i for i, num in enumerate(nums)]
        self.ref_step_ts = [float(e.ts) for e in self.ref_steps]
        self.prefix_max_step: list[int] = []
        best = -1
        for num in nums:
            best = best if num is None else max(best, num)
            self.prefix_max_step.append(best)
        # Per rank: step begins, sorted, and the earliest end among steps from there on.
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for e in ordered:
            if e.kind == STEP:
                by_rank.setdefault(e.rank, []).append((float(e.begin), float(e.ts)))
        self.rank_begins: dict[int, list[float]] = {}
        self.rank_suffix_min_ts: dict[int, list[float]] = {}
        for rank, spans in by_rank.items():
            spans.sort()
            suffix = [0.0] * len(spans)
            low = float("inf")
            for j in range(len(spans) - 1, -1, -1):
                low = min(low, spans[j][1])
                suffix[j] = low
            self.rank_begins[rank] = [b for b, _ in spans]
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


def _fault_record(
    index: int, f: _Fault, timeline: _Timeline, t1: float, skips: int | None = None
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
        )
    recovery_s = downtime_s = None
    steps_lost = None
    if f.resume_ts is not None and f.threshold is not None:
        downtime_s = f.resume_ts - f.fault_ts
        recovery_s = timeline.recovered_ts(f.threshold) - f.fault_ts
        if f.resume_step is not None:
            last_before = timeline.last_step_before(f.fault_ts)
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
        restore_tier=None if load is None else _opt_str(load.get("tier")),
        restored_step=None if load is None else _opt_int(load.get("step")),
    )


def compute(events: Sequence[Event], *, reference_rank: int = 0) -> RunReport:
    """The goodput report of one run's events (any order); raises ValueError if empty."""
    events = [e for e in events if e.kind != ALERT]
    if not events:
        raise ValueError(
            "cannot compute goodput from an empty event list; check that the run directory "
            "holds ledger files (<run_dir>/events/*.jsonl) with records in them"
        )
    ordered = sorted(events, key=_sort_key)
    t0 = min(float(e.begin) for e in ordered)
    t1 = max(float(e.ts) for e in ordered)
    wall_s = t1 - t0
    ref = reference_rank
    timeline = _Timeline(ordered, ref)
    faults = _walk_faults(ordered, ref)

    # Category intervals for the partition; loop = step and blocking-save intervals.
    intervals: list[tuple[float, float, int]] = []
    loop: list[tuple[float, float]] = []
    for e in ordered:
        if e.rank != ref or e.kind not in (CKPT_STAGE, CKPT_LOAD, PHASE):
            continue
        span = (float(e.begin), float(e.ts))
        if e.kind == CKPT_STAGE:
            intervals.append((*span, _PRIO["checkpoint_save"]))
            loop.append(span)
        elif e.kind == CKPT_LOAD:
            intervals.append((*span, _PRIO["checkpoint_load"]))
        else:
            category = _PHASE_CATEGORY.get(str(e.get("name")))
            if category is not None:
                intervals.append((*span, _PRIO[category]))
    # The launcher's own phases until the reference rank's first record are the job's
    # start-up (later ones overlap the workers' phases and restarts, accounted for by those).
    first_ref = min((float(e.begin) for e in ordered if e.rank == ref), default=t1)
    for e in ordered:
        if e.rank == LAUNCHER_RANK and e.kind == PHASE and float(e.begin) < first_ref:
            intervals.append((float(e.begin), min(float(e.ts), first_ref), _PRIO["startup"]))
    for e, alive in zip(timeline.ref_steps, timeline.survives, strict=True):
        span = (float(e.begin), float(e.ts))
        intervals.append((*span, _PRIO["productive" if alive else "reexecuted"]))
        loop.append(span)
    downtime: list[tuple[float, float]] = []
    restoring: list[tuple[float, float]] = []
    for f in faults:
        if f.detection_ts is not None:
            intervals.append((f.fault_ts, f.detection_ts, _PRIO["detection"]))
        start = f.detection_ts if f.detection_ts is not None else f.fault_ts
        end = f.resume_ts if f.resume_ts is not None else t1
        intervals.append((start, end, _PRIO["recovery"]))
        downtime.append((f.fault_ts, end))
        restoring.append((start, end))

    first_step_begin = min((float(e.begin) for e in timeline.ref_steps), default=t1)
    totals, startup_first_s = _partition(intervals, t0, t1, first_step_begin)
    seconds = dict(zip((*CATEGORIES, OTHER), totals, strict=True))
    productive_s = float(seconds.pop("productive"))
    badput_s = {name: float(seconds[name]) for name in BADPUT_CATEGORIES}
    skips = [(float(e.ts), e.get("step")) for e in ordered if e.kind == CKPT_SKIP]
    records = [
        _fault_record(i, f, timeline, t1, _skips_after(skips, faults, i, t1))
        for i, f in enumerate(faults)
    ]

    checkpoint_save_s = badput_s["checkpoint_save"]
    loop_s = _union_measure(loop)
    ettr_den = wall_s - startup_first_s
    surviving_durs = [
        float(e.ts) - float(e.begin)
        for e, alive in zip(timeline.ref_steps, timeline.survives, strict=True)
        if alive
    ]
    recoveries = [r.recovery_s for r in records if r.recovery_s is not None]
    runs = Counter(e.run for e in ordered if e.run)
    return RunReport(
        run=min(runs, key=lambda r: (-runs[r], r)) if runs else "",
        wall_s=float(wall_s),
        productive_s=productive_s,
        steps_completed=len(timeline.last_exec),
        training_goodput=productive_s / wall_s if wall_s > 0 else 0.0,
        infra_goodput=1.0 - _union_measure(restoring) / wall_s if wall_s > 0 else 1.0,
        availability=1.0 - _union_measure(downtime) / wall_s if wall_s > 0 else 1.0,
        checkpoint_efficiency=1.0 - checkpoint_save_s / loop_s if loop_s > 0 else None,
        ettr=productive_s / ettr_den if ettr_den > 0 else None,
        badput_s=badput_s,
        faults=records,
        num_attempts=len({e.attempt for e in ordered}),
        num_iterations=max(e.iteration for e in ordered) + 1,
        checkpoint_save_s=checkpoint_save_s,
        loop_s=float(loop_s),
        step_time_s_median=float(statistics.median(surviving_durs)) if surviving_durs else None,
        recovery_s_median=float(statistics.median(recoveries)) if recoveries else None,
        recovery_s_max=float(max(recoveries)) if recoveries else None,
    )


def _skips_after(
    skips: list[tuple[float, Any]], faults: list[_Fault], i: int, t1: float
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


def _walk_faults(ordered: list[Event], ref: int) -> list[_Fault]:
    """Open, detect, attach restarts to and resume faults, in event order."""
    faults: list[_Fault] = []
    open_: list[_Fault] = []
    for e in ordered:
        kind = e.kind
        if kind == FAULT_INJECTED:
            f = _Fault(
                fault_ts=float(e.ts),
                rank=e.rank,
                kind=_opt_str(e.get("fault")),
                step=_opt_int(e.get("step")),
                injected=True,
            )
            faults.append(f)
            if e.get("disruptive", True) is False:  # nothing to recover: never opened
                f.disruptive = False
                f.resume_ts = f.threshold = f.fault_ts
                continue
            open_.append(f)
        elif kind == FAULT_DETECTED:
            ts = float(e.ts)
            target = next((f for f in open_ if f.detection_ts is None and f.fault_ts <= ts), None)
            if target is None and any(f.fault_ts <= ts for f in open_):
                # A further detection inside an outage already detected (a peer's collective
                # failing after the faulty rank raised) belongs to that outage.
                continue
            if target is None:
                fault_rank = e.get("fault_rank")
                target = _Fault(
                    fault_ts=ts,
                    rank=e.rank if fault_rank is None else int(fault_rank),
                    kind=_opt_str(e.get("cause")),
                    step=None,
                    injected=False,
                )
                faults.append(target)
                open_.append(target)
            target.detection_ts = ts
            target.cause = _opt_str(e.get("cause"))
            target.detector = _opt_str(e.get("detector"))
            if e.get("layer") is not None:
                target.layer = str(e.get("layer"))
        elif kind in (RESTART_BEGIN, RESTART_END):
            for f in open_:
                if f.layer is None and e.get("layer") is not None:
                    f.layer = str(e.get("layer"))
                if kind == RESTART_END:
                    f.last_restart_end = float(e.ts)
        elif kind == STEP and e.rank == ref and open_:
            begin = float(e.begin)
            still_open = []
            for f in open_:
                threshold = f.current_threshold()
                if begin >= threshold:
                    f.threshold = threshold
                    f.resume_ts = begin
                    f.resume_step = _opt_int(e.get("step"))
                else:
                    still_open.append(f)
            open_ = still_open
    return faults
