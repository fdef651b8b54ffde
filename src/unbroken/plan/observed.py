"""What one run's ledger measured of its compute and storage: ``observe(RUN_DIR)``.

The figures ``unbroken plan --from RUN --recommend`` sizes intervals and timeouts on, each
from the reference rank's records (rank 0) unless said otherwise:

- ``step_s``: the surviving steps' compute (a ``step`` record's ``dur_s`` less the blocking
  ``ckpt_stage`` intervals inside it); ``gap_s``: every step record's ``dur_s`` (the progress
  gap a hang watchdog sees, saves included); both leave out each start's first step (an
  ``(attempt, iteration)``'s first record: warm-up, covered by the initial timeout);
- blocking costs: ``save_s`` (``ckpt_stage`` with ``durable`` true, or without the field),
  ``snapshot_s`` (``durable`` false), ``note_s`` (``part`` "note");
- storage: ``persist_s`` (every rank's ``ckpt_persist`` ``dur_s``) and ``durable_lag_s`` (a
  durable save's staging end to its ``ckpt_commit``: how soon the next save can be durable);
- ``restore_s``: ``ckpt_load`` ``dur_s`` by tier ("disk", "memory", "peer"), any time;
- ``phases``: every training rank's ``phase`` records by name (any name), plus what the
  checkpoint records say of the phases unbroken knows: "save" (every ``ckpt_stage`` but notes
  and overlap waits), "persist", "restore" (every ``ckpt_load``) and, per recovered fault,
  "recovery" (detection to training again);
- the disruptive faults of ``goodput.compute`` and ``train_s`` (surviving, re-executed and
  save-blocked step time: what a fault rate is per).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.ledger import FaultRecord, RunReport, goodput, read_run
from unbroken.ledger import events as ev
from unbroken.plan import measured

REFERENCE_RANK = 0
SAVE, PERSIST, RESTORE, RECOVERY = "save", "persist", "restore", "recovery"


@dataclass(frozen=True)
class Durations:
    """Seconds of the intervals of one kind a run recorded."""

    values: tuple[float, ...] = ()

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def max(self) -> float | None:
        return max(self.values) if self.values else None

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "median": self.median, "max": self.max}


def _durations(values: Iterable[float]) -> Durations:
    return Durations(tuple(float(v) for v in values))


@dataclass(frozen=True, kw_only=True)
class Observed:
    """One run's measured figures (see the module docstring for each)."""

    run: str
    run_dir: str
    world_size: int
    """Training ranks (the largest ``world_size`` a ``process_start`` gave, else those seen)."""
    nodes: int
    """Distinct hosts of the training ranks."""
    steps_completed: int
    step_s: Durations
    gap_s: Durations
    first_step_s: Durations
    save_s: Durations
    snapshot_s: Durations
    note_s: Durations
    persist_s: Durations
    durable_lag_s: Durations
    restore_s: dict[str, Durations]
    """By ledger tier ("disk", "memory", "peer")."""
    phases: dict[str, Durations]
    shard_bytes: float | None
    """One rank's staged bytes (a durable save's, else a snapshot's)."""
    ckpt_every: int | None
    """The durable interval the run used (its due saves' steps), None if fewer than two."""
    snapshot_every: int | None
    """The interval of its staged snapshots, None if fewer than two."""
    skipped_saves: int
    """Due durable saves skipped because the previous one was still persisting."""
    faults: tuple[FaultRecord, ...]
    """The disruptive faults, in order."""
    train_s: float
    """Seconds of step and save-blocked time: what the run's fault rate is per."""
    report: RunReport = field(repr=False)
    planner: measured.Measured = field(repr=False)
    """The planner inputs ``plan --from`` reads of the same run."""

    def to_dict(self) -> dict[str, Any]:
        plain = ("run", "run_dir", "world_size", "nodes", "steps_completed", "shard_bytes")
        out: dict[str, Any] = {name: getattr(self, name) for name in plain}
        for name in ("step_s", "gap_s", "first_step_s", "save_s", "snapshot_s", "note_s"):
            out[name] = getattr(self, name).to_dict()
        out["persist_s"] = self.persist_s.to_dict()
        out["durable_lag_s"] = self.durable_lag_s.to_dict()
        out["restore_s"] = {k: v.to_dict() for k, v in self.restore_s.items()}
        out["phases"] = {k: v.to_dict() for k, v in self.phases.items()}
        out |= {
            "ckpt_every": self.ckpt_every,
            "snapshot_every": self.snapshot_every,
            "skipped_saves": self.skipped_saves,
            "faults": [f.to_dict() for f in self.faults],
            "train_s": self.train_s,
        }
        return out


def _interval_of(steps: Iterable[int]) -> int | None:
    ordered = sorted(set(steps))
    diffs = [b - a for a, b in zip(ordered, ordered[1:], strict=False)]
    return min(diffs) if diffs else None


def _compute(step_records: list[ev.Event], stages: list[ev.Event]) -> dict[int, float]:
    """Per step record (by id): its ``dur_s`` less the blocking stages that lie inside it."""
    stages = sorted(stages, key=lambda e: e.begin)
    begins = [e.begin for e in stages]
    out = {}
    for e in step_records:
        d = float(e.dur_s or 0.0)
        i = bisect.bisect_left(begins, e.begin)
        blocked = 0.0
        while i < len(stages) and stages[i].begin < e.ts:
            if stages[i].ts <= e.ts:
                blocked += float(stages[i].dur_s or 0.0)
            i += 1
        out[id(e)] = max(0.0, d - blocked)
    return out


def observe(run_dir: str | Path) -> Observed:
    """Measure the run whose ledger is under ``run_dir``.

    Raises:
        FileNotFoundError: no such directory, or no ledger in it.
        ValueError: the ledger has no records, or no completed step.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--from {path}: no such run directory; pass the --run-dir a training job wrote"
        )
    result = read_run(path, fold_steps_except=REFERENCE_RANK)
    if not result.events:
        raise ValueError(f"the ledger in {path} has no records; is it a run directory?")
    rep = goodput.compute(result.events, digest=result.digest)
    if rep.steps_completed < 1:
        raise ValueError(
            f"the ledger in {path} has no completed step: nothing to size intervals or "
            "timeouts on; run the job for a few dozen steps and pass that run directory"
        )
    ref = [e for e in result.events if e.rank == REFERENCE_RANK]
    step_records = [e for e in ref if e.kind == ev.STEP and e.dur_s is not None]
    stages = [e for e in ref if e.kind == ev.CKPT_STAGE and e.dur_s is not None]
    compute = _compute(step_records, stages)

    last_of: dict[Any, ev.Event] = {}  # surviving execution of each step number
    first_of: dict[tuple[int, int], ev.Event] = {}  # first record of each start
    for e in step_records:  # read_run sorts by ts
        if e.get("step") is not None:
            last_of[e.get("step")] = e
        first_of.setdefault((e.attempt, e.iteration), e)
    firsts = {id(e) for e in first_of.values()}
    surviving = [e for e in last_of.values() if id(e) not in firsts] or list(last_of.values())

    saves = [e for e in stages if e.get("part") is None and e.get("durable", True)]
    snapshots = [e for e in stages if e.get("part") is None and e.get("durable") is False]
    notes = [e for e in stages if e.get("part") == "note"]
    commits: dict[Any, list[float]] = defaultdict(list)  # a step may be saved again
    for e in result.events:
        if e.kind == ev.CKPT_COMMIT:
            commits[e.get("step")].append(e.ts)
    lags = []
    for e in saves:
        after = [ts for ts in commits.get(e.get("step"), []) if ts > e.ts]
        if after:
            lags.append(min(after) - e.ts)
    persists = [e.dur_s for e in result.events if e.kind == ev.CKPT_PERSIST and e.dur_s is not None]
    loads = [e for e in ref if e.kind == ev.CKPT_LOAD and e.dur_s is not None]
    restore: dict[str, list[float]] = defaultdict(list)
    for e in loads:
        if e.get("tier") not in (None, "none"):
            restore[str(e.get("tier"))].append(float(e.dur_s or 0.0))

    phases: dict[str, list[float]] = defaultdict(list)
    for e in result.events:
        if e.kind == ev.PHASE and e.rank >= 0 and e.dur_s is not None and e.get("name"):
            phases[str(e.get("name"))].append(e.dur_s)
    phases[SAVE] += [float(e.dur_s or 0.0) for e in stages if e.get("part") is None]
    phases[PERSIST] += persists
    phases[RESTORE] += [float(e.dur_s or 0.0) for e in loads]
    faults = tuple(f for f in rep.faults if f.disruptive)
    phases[RECOVERY] += [
        f.downtime_s - (f.detection_s or 0.0) for f in faults if f.downtime_s is not None
    ]

    starts = [e for e in result.events if e.kind == ev.PROCESS_START and e.rank >= 0]
    ranks = {e.rank for e in starts} | {e.rank for e in step_records}
    world = max([int(e.get("world_size") or 0) for e in starts] + [len(ranks), 1])
    hosts = {e.get("host") for e in starts if e.get("host")}
    skips = [e for e in ref if e.kind == ev.CKPT_SKIP and e.get("step") is not None]
    saved = sorted(int(e.get("step")) for e in saves if e.get("step") is not None)
    # A save held back (one copy, the writer still reading it) is staged at a later step: the
    # first save after its skip is that save again, not one that fell due there.
    delayed = {
        next((s for s in saved if s > int(e.get("step"))), None) for e in skips if e.get("retried")
    }
    # A save skipped while the previous one persists stays due: skipped again at every step
    # (the same reason) until it is staged; such a run of skips is one save that fell due.
    reasons = {int(e.get("step")): e.get("reason") for e in skips}
    fell_due = [s for s, why in reasons.items() if s - 1 not in reasons or reasons[s - 1] != why]
    due = [s for s in saved if s not in delayed] + fell_due
    sized = [e for e in saves if e.get("bytes")] or [e for e in snapshots if e.get("bytes")]
    return Observed(
        run=rep.run or path.name,
        run_dir=str(path),
        world_size=world,
        nodes=max(1, len(hosts)),
        steps_completed=rep.steps_completed,
        step_s=_durations(compute[id(e)] for e in surviving),
        gap_s=_durations(float(e.dur_s or 0.0) for e in step_records if id(e) not in firsts),
        first_step_s=_durations(float(e.dur_s or 0.0) for e in first_of.values()),
        save_s=_durations(float(e.dur_s or 0.0) for e in saves),
        snapshot_s=_durations(float(e.dur_s or 0.0) for e in snapshots),
        note_s=_durations(float(e.dur_s or 0.0) for e in notes),
        persist_s=_durations(persists),
        durable_lag_s=_durations(lags),
        restore_s={k: _durations(v) for k, v in sorted(restore.items())},
        phases={k: _durations(v) for k, v in phases.items() if v},
        shard_bytes=statistics.median(float(e.get("bytes")) for e in sized) if sized else None,
        ckpt_every=_interval_of(s for s in due if s is not None),
        snapshot_every=_interval_of(
            e.get("step") for e in saves + snapshots if e.get("step") is not None
        ),
        skipped_saves=sum(1 for e in ref if e.kind == ev.CKPT_SKIP),
        faults=faults,
        train_s=rep.productive_s + rep.checkpoint_save_s + rep.badput_s.get("reexecuted", 0.0),
        report=rep,
        planner=measured.from_report(
            rep.to_dict(), measured.restores_after_faults(result.events, rep)
        ),
    )
