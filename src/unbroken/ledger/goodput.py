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
    and ``ckpt_persist`` records inform no figure beyond ``t0``/``t1``, ``ckpt_commit`` and
    ``ckpt_fail`` none beyond those and ``storage``.

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
    * ``restart_begin``/``restart_end`` give ``layer`` to every open fault. A fault's layer,
      the one that recovered it, is the outermost that acted on it (inprocess < launcher <
      orchestrator: an in-process restart that gave up, as on a hang in native code, ends as
      the launcher's); ``restart_end`` also records its ``ts`` on every open fault. A
      ``restart_end`` of status "stopped" (a rank's in-process restart given up because the
      launcher stopped it to restart it) takes its round back from every open fault instead.
    * A fault's threshold is max(fault time, detection ts, last attached ``restart_end`` ts).
      A reference-rank ``step`` record whose ``begin`` >= the threshold *resumes* (and closes)
      every open fault it satisfies: ``resume_ts`` = that ``begin``. The walk meets a step
      record at its ``ts`` (its end), so only records up to then count toward the threshold.
      A ``job_end`` with status "ok" resumes every fault still open (a fault after the last
      step, in shutdown): ``resume_ts`` = max(its ``ts``, the threshold), ``recovery_s`` =
      ``downtime_s``, ``steps_lost`` = 0.
    * ``recovered_ts``: for every rank with a ``step`` record whose ``begin`` >= the threshold,
      the ``ts`` of its first such record; the max over those ranks.
    * ``restore_tier``/``restored_step``: ``tier``/``step`` of the last reference-rank
      ``ckpt_load`` whose ``ts`` lies in [fault time, resume_ts] ([fault time, t1] when not
      resumed); None when there is none.
    * ``detection_s`` = detection ts - fault time (None without detection);
      ``downtime_s`` = resume_ts - fault time; ``recovery_s`` = recovered_ts - fault time;
      ``steps_lost`` = max(0, last_step_before + 1 - first_step_after), where last_step_before
      is the highest step number of a reference-rank step record with ``ts`` <= the detection
      ts (the fault time when undetected; -1 if none) and first_step_after is the number of
      the resuming step. The last three are None when the fault never resumed.
    * ``phase``: the ``phase`` of the ``fault_injected`` record, ``step`` when it names none;
      for a natural fault the ``phase`` of the detection that opened it, else None.
      ``fault_class``: from the injected ``fault`` kind, or the natural fault's cause
      (``fault_classes``). ``restarts``: the distinct restart rounds among the
      ``restart_begin`` records met while the fault was open, a round being (layer, ``round``)
      when the record has a ``round``, else (layer, attempt, iteration): the per-rank records
      of one round count once. A ``job_end`` with status ``failed`` and a ``round`` takes the
      launcher's round of that number back from every open fault (the agent gave up instead
      of restarting).

Partition of [t0, t1]
    Each category below is a set of intervals; every elementary piece of [t0, t1] is assigned
    to the highest-priority category that covers it (a sweep over sorted boundaries), the rest
    to ``other``. Highest priority first:

    1. ``checkpoint_save``: reference-rank ``ckpt_stage`` intervals (the trainer was blocked).
    2. ``checkpoint_load``: reference-rank ``ckpt_load`` intervals (and phase ``ckpt_load``).
    3. phases, by name, in this order: ``startup`` (phase ``import``), ``rendezvous``,
       ``pg_init``, ``model_build``, ``data``, ``custom`` (every other valid name: the
       user's own, ``RestartContext.phase``), ``preemption`` (a graceful stop's last save,
       from its staging to its commit: ``unbroken.checkpoint.preempt``), ``shutdown``.
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
    * ``fault_s``: what the faults cost, the measure of (the union over faults of [fault time,
      ``resume_ts`` or ``t1``] and the ``reexecuted`` step intervals) less the time assigned to
      ``checkpoint_save`` or ``productive``. A restarted process's start-up phases inside a
      window count here (they are the fault's), though the partition names them ``startup``,
      ``pg_init``, ...; so ``productive_s + checkpoint_save_s + fault_s <= wall_s``, and the
      gap between a faulted run and a clean one splits into ``fault_s`` and the saves.
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
    * ``custom_s``: per user phase name, the measure of the union of its reference-rank
      intervals (what the ``custom`` category holds, by name; overlaps other categories only
      where a higher one covers it).
    * ``ml_badput_s()``: ``badput_s`` summed into Google's ml-goodput-measurement categories
      (``ML_GOODPUT``).
    * ``by_class``/``by_phase``: ``fault_summary.by_class``/``by_phase`` of the faults:
      per class and per phase, recovery rate, recovery time p50/p95/max, failed restart
      attempts, steps lost per incident, detection p50 (defined in ``fault_summary``).

Degradation (``degraded``)
    A non-disruptive ``fault_injected`` record with a finite ``window_s`` > 0 (``slow-rank``,
    ``network``) has the degradation window [its ts, ts + ``window_s``]. Training goes on in
    it, slower: its cost is step time, not an outage, and the partition above does not change
    (a slow step that survives is productive). A surviving reference-rank step is inside a
    window when its interval overlaps it. ``step_time_s_outside``: the median ``dur_s`` of the
    surviving steps inside no window (None without a window). Per fault: ``window_s``,
    ``step_s_inside`` (median over its window's steps) and ``degraded_s`` = max(0, their
    summed ``dur_s`` - their number x ``step_time_s_outside``). ``degraded_s`` of the run:
    the same over the steps inside any window (0.0 without one).

Checkpoint storage (``storage``: ``unprotected.storage_failures`` up to ``t1``)
    A failed save does not stop training (the memory tier holds the state), but until a
    checkpoint commits again a lost node loses everything since the newest commit. An
    *unprotected interval* begins at the first ``ckpt_fail`` (on any rank) after the newest
    ``ckpt_commit`` (or after the run's start if there is none), and ends at the next
    ``ckpt_commit``, or at ``t1`` if none comes; at equal ``ts`` the commit comes second. A
    ``ckpt_fail`` with ``phase: "load"`` (a checkpoint rejected at restore) is no save and is
    left out. ``unprotected_s``: the sum of those intervals (0.0 without a failure);
    ``failing_since``: the begin of the one still open at ``t1`` (the newest failure is newer
    than the newest commit), else None; ``failed_saves``: the distinct saves (attempt,
    iteration, step) that failed; ``saves_held_back``: those skipped with a ``reason`` that
    begins "storage failing"; ``last_error``: the newest failure's ``error``.

Stragglers (``stragglers``)
    Every rank's ``step`` records that carry ``busy_s`` (the training thread's time on or
    waiting for a CPU during the step) give ``stragglers``: ``stragglers.find`` over windows
    of ``stragglers.window_for`` the reference rank's first step durations, from ``t0`` to
    ``t1``; a list of ``Straggler`` episodes by begin (empty without ``busy_s``).

Cost: O(n log n) in the number of events. Other ranks' step records may come folded
(``reader.StepDigest``: ``read_run(fold_steps_except=reference_rank)``): they inform only
``t0``/``t1``, ``recovered_ts``, ``run``, ``num_attempts``, ``num_iterations`` and
``stragglers``, which read the digest alike, so the report is the same and its memory 16 bytes
per folded step (24 with ``busy_s``).

Files: this one (the partition and the figures), ``runreport`` (the report and the categories),
``fault_records`` (the walk over faults),
``fault_classes`` (a fault's class and phase) and ``fault_summary`` (the figures per class and
per phase); ``degraded`` (the windows' cost), ``stragglers`` and ``unprotected`` (the storage
failures).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from unbroken.ledger import degraded, stragglers
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
from unbroken.ledger.fault_records import (
    FaultRecord,
    Timeline,
    fault_record,
    skips_after,
    walk_faults,
)
from unbroken.ledger.fault_summary import by_class, by_phase
from unbroken.ledger.reader import StepDigest
from unbroken.ledger.runreport import (
    BADPUT_CATEGORIES,
    CATEGORIES,
    ML_GOODPUT,
    OTHER,
    RunReport,
)
from unbroken.ledger.unprotected import StorageFailures, storage_failures

__all__ = [
    "BADPUT_CATEGORIES",
    "CATEGORIES",
    "ML_GOODPUT",
    "OTHER",
    "FaultRecord",
    "RunReport",
    "StorageFailures",
    "compute",
]

_PRIO = {name: i for i, name in enumerate(CATEGORIES)}
_PHASE_CATEGORY = {
    "import": "startup",
    "rendezvous": "rendezvous",
    "pg_init": "pg_init",
    "model_build": "model_build",
    "data": "data",
    "shutdown": "shutdown",
    "preemption": "preemption",
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


def _sort_key(e: Event) -> tuple[float, int, int, int, int]:
    return (float(e.ts), _KIND_ORDER.get(e.kind, 0), e.rank, e.attempt, e.iteration)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _union_measure(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in _merged(intervals))


def _measure_less(covered: list[tuple[float, float]], less: list[tuple[float, float]]) -> float:
    """The measure of the union of ``covered`` minus the union of ``less``."""
    a, b = _merged(covered), _merged(less)
    overlap, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            overlap += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return sum(e - s for s, e in a) - overlap


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


def compute(
    events: Sequence[Event], *, reference_rank: int = 0, digest: StepDigest | None = None
) -> RunReport:
    """The goodput report of one run's events.

    Args:
        events: The run's records, in any order.
        reference_rank: The rank whose ``step``, ``phase``, ``ckpt_stage`` and ``ckpt_load``
            records make the run's timeline (see the module docstring).
        digest: Other ranks' step records folded by ``read_run(fold_steps_except=...)`` (with
            the same reference rank); the figures are those of the unfolded events.

    Returns:
        The report.

    Raises:
        ValueError: When there are no events.
    """
    events = [e for e in events if e.kind != ALERT]
    folded = digest if digest is not None and digest.count else None
    if not events and folded is None:
        raise ValueError(
            "cannot compute goodput from an empty event list; check that the run directory "
            "holds ledger files (<run_dir>/events/*.jsonl) with records in them"
        )
    ordered = sorted(events, key=_sort_key)
    t0 = min((float(e.begin) for e in ordered), default=float("inf"))
    t1 = max((float(e.ts) for e in ordered), default=float("-inf"))
    if folded is not None:
        t0, t1 = min(t0, folded.t0), max(t1, folded.t1)
    wall_s = t1 - t0
    ref = reference_rank
    timeline = Timeline(ordered, ref, folded.spans if folded is not None else None)
    faults = walk_faults(ordered, ref)

    # Category intervals for the partition; loop = step and blocking-save intervals.
    intervals: list[tuple[float, float, int]] = []
    loop: list[tuple[float, float]] = []
    custom: dict[str, list[tuple[float, float]]] = {}
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
            name = str(e.get("name"))
            category = _PHASE_CATEGORY.get(name, "custom")
            intervals.append((*span, _PRIO[category]))
            if category == "custom":
                custom.setdefault(name, []).append(span)
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
    step_spans = [(float(e.begin), float(e.ts)) for e in timeline.ref_steps]
    alive_spans = [x for x, alive in zip(step_spans, timeline.survives, strict=True) if alive]
    redone = [x for x, alive in zip(step_spans, timeline.survives, strict=True) if not alive]
    saves = [
        (float(e.begin), float(e.ts)) for e in ordered if e.rank == ref and e.kind == CKPT_STAGE
    ]
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
        fault_record(i, f, timeline, t1, skips_after(skips, faults, i, t1))
        for i, f in enumerate(faults)
    ]

    checkpoint_save_s = badput_s["checkpoint_save"]
    loop_s = _union_measure(loop)
    ettr_den = wall_s - startup_first_s
    surviving_durs = [e - s for s, e in alive_spans]
    fault_spans = [(max(s, t0), min(e, t1)) for s, e in downtime + redone]
    recoveries = [r.recovery_s for r in records if r.recovery_s is not None]
    windows = [(r.fault_ts, r.fault_ts + r.window_s) for r in records if r.window_s]
    outside_s, inside, degraded_s = degraded.cost(alive_spans, windows)
    priced = iter(inside)
    records = [_priced(r, next(priced)) if r.window_s else r for r in records]
    runs = Counter(e.run for e in ordered if e.run)
    attempts = {e.attempt for e in ordered}
    max_iteration = max((e.iteration for e in ordered), default=0)
    if folded is not None:
        runs.update(folded.runs)
        attempts |= folded.attempts
        max_iteration = max(max_iteration, folded.max_iteration)
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
        num_attempts=len(attempts),
        num_iterations=max_iteration + 1,
        checkpoint_save_s=checkpoint_save_s,
        fault_s=float(_measure_less(fault_spans, alive_spans + saves)),
        loop_s=float(loop_s),
        step_time_s_median=float(statistics.median(surviving_durs)) if surviving_durs else None,
        recovery_s_median=float(statistics.median(recoveries)) if recoveries else None,
        recovery_s_max=float(max(recoveries)) if recoveries else None,
        by_class=by_class(records),
        by_phase=by_phase(records),
        custom_s={name: float(_union_measure(spans)) for name, spans in sorted(custom.items())},
        step_time_s_outside=outside_s,
        degraded_s=degraded_s,
        stragglers=stragglers.find(
            stragglers.samples_of(ordered, folded),
            t0=t0,
            t1=t1,
            window_s=stragglers.window_for(float(e.dur_s or 0.0) for e in timeline.ref_steps),
        ),
        storage=storage_failures(ordered, t1=t1),
    )


def _priced(record: FaultRecord, figures: tuple[float | None, float | None]) -> FaultRecord:
    inside, cost = figures
    return replace(record, step_s_inside=inside, degraded_s=cost)
