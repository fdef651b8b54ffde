"""What the dashboard shows of one run, as one JSON-able dict, from its events and its report.

Every goodput figure is the ``RunReport``'s (``unbroken.ledger.goodput.compute``), so the page,
``/metrics`` and ``unbroken report`` agree. What the report does not hold is read from the
records here, by these definitions:

- step series: the reference rank's (0) step records, (seconds since t0, step number), thinned
  to at most ``MAX_POINTS`` (a rollback is a drop in the line; every drop is kept);
- step rate: reference-rank step records ending in the last ``RATE_WINDOW_S`` of the ledger,
  per second of that window;
- heartbeat age of a rank: ``now`` minus the end of its last step record (``ctx.step_done`` sends
  the launcher's heartbeat and writes that record together);
- step time of a rank: median ``dur_s`` of its last ``RANK_WINDOW`` steps; deviation: that over
  the median across ranks, minus 1 (in synchronous training every rank's step takes as long,
  so this names no straggler: it shows ranks out of step, e.g. one restarting);
- busy ratio of a rank: the sum of ``busy_s`` over the sum of ``dur_s`` of its last
  ``RANK_WINDOW`` steps that carry ``busy_s`` (None without); a rank is a straggler when
  ``ledger.stragglers.judge`` names it among these ratios (the report's straggler episodes
  are in ``stragglers``, the degradation cost in ``figures.degraded_s``);
- checkpoint freshness: the newest ``ckpt_commit``'s step and age, steps completed since it,
  saves skipped (total, and in a row since the last commit), saves in flight (staged by the
  reference rank, neither committed nor failed nor skipped), staging memory and writer RSS from
  the newest ``ckpt_stage`` / ``ckpt_persist`` records;
- checkpoint storage: the report's ``storage`` (``unbroken.ledger.unprotected``): failed saves,
  saves held back, the seconds the run went unprotected by durable checkpoints (up to the
  ledger's newest record), the last error, and ``storage_failing``: the newest save failure
  is newer than the newest commit (since ``storage_failing_since``, epoch seconds).
"""

from __future__ import annotations

import statistics
from typing import Any

from unbroken.dashboard.alerts import restart_budget
from unbroken.dashboard.index import REF, EventIndex
from unbroken.ledger import events as ev
from unbroken.ledger.events import Event
from unbroken.ledger.goodput import ML_GOODPUT, RunReport
from unbroken.ledger.stragglers import judge
from unbroken.ledger.unprotected import StorageFailures

MAX_POINTS = 2000
RATE_WINDOW_S = 30.0
RANK_WINDOW = 20


def _thin(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """At most about MAX_POINTS, keeping the first, the last, and both sides of every drop."""
    if len(points) <= MAX_POINTS:
        return points
    stride = len(points) // MAX_POINTS + 1
    keep = {0, len(points) - 1}
    for i in range(1, len(points)):
        if points[i][1] < points[i - 1][1]:
            keep.update((i - 1, i))
    keep.update(range(0, len(points), stride))
    return [points[i] for i in sorted(keep)]


def status_of(index: EventIndex) -> str:
    """``running``, ``ok`` or ``failed``: the launcher's job_end, else rank 0's, else running."""
    job_ends = index.get(ev.JOB_END)
    launcher = [e for e in job_ends if e.rank == ev.LAUNCHER_RANK]
    ends = launcher or [e for e in job_ends if e.rank == REF]
    if not ends:
        return "running"
    return "ok" if all(e.get("status") == "ok" for e in ends) else "failed"


def _checkpoint(
    index: EventIndex, steps_ts: list[tuple[float, int]], now: float, storage: StorageFailures
) -> dict[str, Any]:
    commit = stage = persist = None
    staged: dict[int, float] = {}
    done: set[int] = set()
    skips: list[int] = []
    skipped_total: set[int] = set()
    blocking: list[float] = []
    persists: list[tuple[float, int, float]] = []
    ckpt_kinds = (ev.CKPT_STAGE, ev.CKPT_PERSIST, ev.CKPT_COMMIT, ev.CKPT_SKIP, ev.CKPT_FAIL)
    for e in sorted(index.kinds(*ckpt_kinds), key=lambda e: e.ts):
        if e.kind == ev.CKPT_COMMIT:
            commit = e if commit is None or e.ts >= commit.ts else commit
            done.add(int(e.get("step", -1)))
            skips = []
        elif e.rank != REF:
            if e.kind == ev.CKPT_PERSIST:
                persist = e if persist is None or e.ts >= persist.ts else persist
            continue
        elif e.kind == ev.CKPT_STAGE:
            if e.get("part") != "note":  # a note blocks, but stages nothing
                stage = e if stage is None or e.ts >= stage.ts else stage
                staged[int(e.get("step", -1))] = e.ts
            if e.dur_s is not None:
                blocking.append(e.dur_s)
        elif e.kind == ev.CKPT_PERSIST:
            persist = e if persist is None or e.ts >= persist.ts else persist
            if e.dur_s is not None:
                persists.append((e.ts, int(e.get("step", -1)), e.dur_s))
        elif e.kind in (ev.CKPT_SKIP, ev.CKPT_FAIL):
            done.add(int(e.get("step", -1)))
            if e.kind == ev.CKPT_SKIP:
                skips.append(int(e.get("step", -1)))
                skipped_total.add(int(e.get("step", -1)))
    commit_step = None if commit is None else commit.get("step")
    since = None
    if commit is not None:
        since = len({s for t, s in steps_ts if t > commit.ts})
    persists.sort()
    return {
        "enabled": bool(staged or commit is not None or skipped_total or storage.failed_saves),
        "last_commit_step": commit_step,
        "last_commit_ts": None if commit is None else commit.ts,
        "last_commit_age_s": None if commit is None else max(0.0, now - commit.ts),
        "steps_since_commit": since,
        "skipped_total": len(skipped_total),
        "skipped_in_a_row": len(set(skips)),
        "in_flight": len([s for s in staged if s not in done and s > (commit_step or -1)]),
        "staging_bytes": None if stage is None else stage.get("staging_bytes"),
        "staged_bytes": None if stage is None else stage.get("bytes"),
        "writer_rss_bytes": None if persist is None else persist.get("writer_rss_bytes"),
        "blocking_s_median": statistics.median(blocking) if blocking else None,
        "persist_s_last": persists[-1][2] if persists else None,
        "persist_s_median": statistics.median(p[2] for p in persists) if persists else None,
        "persist_series": [[p[1], p[2]] for p in persists[-200:]],
        "storage_failing": storage.failing,
        "storage_failing_since": storage.failing_since,
        "unprotected_s": storage.unprotected_s,
        "failed_saves": storage.failed_saves,
        "saves_held_back": storage.saves_held_back,
        "last_error": storage.last_error,
    }


def _ranks(index: EventIndex, now: float) -> list[dict[str, Any]]:
    per: dict[int, list[Event]] = {}
    for e in index.get(ev.STEP):
        if e.rank >= 0:
            per.setdefault(e.rank, []).append(e)
    rows = []
    for rank, recs in sorted(per.items()):
        recs.sort(key=lambda e: e.ts)
        last = recs[-1]
        durs = [e.dur_s for e in recs[-RANK_WINDOW:] if e.dur_s is not None]
        busy = [e for e in recs if e.get("busy_s") is not None and e.dur_s][-RANK_WINDOW:]
        spent = sum(float(e.dur_s or 0.0) for e in busy)
        rows.append(
            {
                "rank": rank,
                "last_step": last.get("step"),
                "last_ts": last.ts,
                "heartbeat_age_s": max(0.0, now - last.ts),
                "step_time_s": statistics.median(durs) if durs else None,
                "busy_ratio": sum(float(e.get("busy_s")) for e in busy) / spent if spent else None,
                "attempt": last.attempt,
                "iteration": last.iteration,
            }
        )
    times = [r["step_time_s"] for r in rows if r["step_time_s"]]
    mid = statistics.median(times) if times else None
    named = set(judge({r["rank"]: r["busy_ratio"] for r in rows if r["busy_ratio"] is not None}))
    for r in rows:
        dev = None if not mid or r["step_time_s"] is None else r["step_time_s"] / mid - 1.0
        r["deviation"] = dev
        r["straggler"] = r["rank"] in named
    return rows


def build(
    index: EventIndex,
    report: RunReport,
    *,
    name: str,
    now: float,
    alerts: list[dict[str, Any]],
    ledger: dict[str, Any],
) -> dict[str, Any]:
    """The run's snapshot (see the module docstring); ``now`` is epoch seconds."""
    t0, t1 = index.t0, index.t1
    status = status_of(index)
    if status != "running":
        now = t1  # ages of a finished run are frozen at its end
    points = [(e.ts, int(e.get("step"))) for e in index.ref_steps]
    series = _thin([(t - t0, s) for t, s in points])
    rate_from = t1 - RATE_WINDOW_S
    recent = [t for t, _ in points if t >= rate_from]
    span = min(RATE_WINDOW_S, t1 - t0)
    faults = []
    for f in report.faults:
        d = f.to_dict()
        d["t"] = f.fault_ts - t0
        faults.append(d)
    used, budget = restart_budget(index)
    return {
        "name": name,
        "run": report.run,
        "status": status,
        "now": now,
        "t0": t0,
        "t1": t1,
        "wall_s": report.wall_s,
        "figures": {
            "steps_completed": report.steps_completed,
            "last_step": points[-1][1] if points else None,
            "step_rate": len(recent) / span if span > 0 else None,
            "step_time_s_median": report.step_time_s_median,
            "training_goodput": report.training_goodput,
            "infra_goodput": report.infra_goodput,
            "availability": report.availability,
            "checkpoint_efficiency": report.checkpoint_efficiency,
            "ettr": report.ettr,
            "productive_s": report.productive_s,
            "recovery_s_median": report.recovery_s_median,
            "faults": len(report.faults),
            "steps_lost": sum(f.steps_lost or 0 for f in report.faults),
            "degraded_s": report.degraded_s,
            "step_time_s_outside": report.step_time_s_outside,
        },
        "badput_s": report.badput_s,
        "ml_goodput": dict(ML_GOODPUT),
        "custom_s": report.custom_s,
        "series": {"t": [p[0] for p in series], "step": [p[1] for p in series]},
        "faults": faults,
        "by_class": {k: g.to_dict() for k, g in report.by_class.items()},
        "by_phase": {k: g.to_dict() for k, g in report.by_phase.items()},
        "stragglers": [
            {**x.to_dict(), "t": x.begin_ts - t0, "duration_s": x.end_ts - x.begin_ts}
            for x in report.stragglers
        ],
        "checkpoint": _checkpoint(index, points, now, report.storage),
        "ranks": _ranks(index, now),
        "restarts": {
            "launcher_used": used,
            "launcher_budget": budget,
            "attempts": report.num_attempts,
            "inprocess_iterations": report.num_iterations - 1,
        },
        "alerts": alerts,
        "ledger": ledger,
    }
