"""Alert rules over a run's ledger: which conditions hold now, each under a stable dedup key.

``evaluate`` is pure: a run's events, its ``RunReport`` and the time it is evaluated at in, the
alerts that hold out. A caller records each alert whose ``key`` it has not recorded yet (as an
``alert`` ledger record), so an alert fires once per episode however often it is evaluated. The
rules (thresholds in ``AlertConfig``):

- ``fault_recovered`` (info): a fault that recovered (one per fault).
- ``fault_recurring`` (page): ``recurring_count`` faults within ``recurring_window_s`` on the
  same rank, with the same cause, or rolled back to the same restore point; one per cluster
  (a cluster ends when ``recurring_window_s`` passes without another such fault).
- ``no_progress`` (page): ``no_progress_restarts`` faults since the highest step last grew.
- ``restart_budget`` (warning): launcher restarts used >= ``budget_ratio`` of --max-restarts.
- ``no_checkpoint`` (warning): a job that checkpoints has committed none for
  ``max_commit_age_s`` while it still makes steps (once per newest commit).
- ``low_goodput`` (warning): training goodput over the last ``goodput_window_s`` below
  ``min_goodput`` (at most once per window length).
- ``ckpt_skipped`` (warning): ``skipped_in_a_row`` saves skipped on the reference rank without
  a commit between (once per run of skips).
- ``checkpoint_storage_failing`` (warning): the newest failed save is newer than the newest
  commit (``RunReport.storage``: ``ledger.unprotected``): training goes on from the memory tier,
  but a lost node loses every step since that commit; one per unprotected interval.
- ``straggler`` (warning): a rank named a straggler by its busy ratio (``RunReport.stragglers``:
  ``ledger.stragglers``), slowing every rank in a synchronous job; one per episode. It is
  not restarted: a slow rank is no hung rank.

Prometheus users get the same rules over the exported metrics in ``rules/unbroken-alerts.yaml``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from unbroken.dashboard.index import EventIndex
from unbroken.ledger import events as ev
from unbroken.ledger.events import Event
from unbroken.ledger.goodput import FaultRecord, RunReport, compute
from unbroken.ledger.unprotected import STORAGE_FAILING

SEVERITIES = ("info", "warning", "page")


@dataclass(frozen=True, kw_only=True)
class AlertConfig:
    """Thresholds of the alert rules (a YAML file of these keys: ``unbroken dashboard --alerts``)."""

    recurring_count: int = 3
    """Faults sharing a rank, cause or restore point that make a recurrence."""
    recurring_window_s: float = 1800.0
    """Seconds within which those faults must fall."""
    no_progress_restarts: int = 3
    """Faults in a row without a new highest step that mean no progress."""
    budget_ratio: float = 0.8
    """Share of the launcher's restart budget used that raises the alert."""
    max_commit_age_s: float = 1800.0
    """Seconds without a committed checkpoint (while steps are made) that raise the alert."""
    goodput_window_s: float = 1800.0
    """Window of the windowed training goodput."""
    min_goodput: float = 0.5
    """Training goodput over the window below which the alert fires (0-1)."""
    skipped_in_a_row: int = 3
    """Skipped saves in a row that raise the alert."""

    def __post_init__(self) -> None:
        for name in ("recurring_count", "no_progress_restarts", "skipped_in_a_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"alert {name} must be >= 1, got {getattr(self, name)}")
        for name in ("recurring_window_s", "max_commit_age_s", "goodput_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"alert {name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("budget_ratio", "min_goodput"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(
                    f"alert {name} must be a ratio in [0, 1], got {getattr(self, name)}"
                )

    @classmethod
    def from_yaml(cls, path: str | Path) -> AlertConfig:
        """Thresholds from a YAML mapping of field names; ValueError names a bad key or value."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"alert config {p} does not exist")
        try:
            obj = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{p}: not valid YAML: {e}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(obj, dict) or set(obj) - names:
            bad = sorted(set(obj) - names) if isinstance(obj, dict) else obj
            raise ValueError(f"{p}: unknown alert settings {bad!r}; valid keys: {sorted(names)}")
        try:
            return cls(**obj)
        except TypeError as e:
            raise ValueError(f"{p}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Alert:
    """One alert that holds."""

    name: str
    """The rule (``fault_recurring``, ...)."""
    severity: str
    """info, warning or page."""
    key: str
    """Dedup key: the same key is recorded once."""
    summary: str
    """One line for a person."""
    ts: float
    """Epoch seconds the condition began to hold (as far as the ledger tells)."""
    labels: dict[str, str] = field(default_factory=dict)
    """What it is about (rank, cause, restore point, ...)."""
    value: float | None = None
    """The measured figure that tripped it."""

    def data(self) -> dict[str, Any]:
        """The fields of its ``alert`` ledger record."""
        return {
            "name": self.name,
            "severity": self.severity,
            "key": self.key,
            "summary": self.summary,
            "labels": dict(self.labels),
            "value": self.value,
            "since": self.ts,
        }

    @classmethod
    def from_event(cls, e: Event) -> Alert:
        return cls(
            name=str(e.get("name", "")),
            severity=str(e.get("severity", "info")),
            key=str(e.get("key", "")),
            summary=str(e.get("summary", "")),
            ts=float(e.get("since", e.ts)),
            labels={str(k): str(v) for k, v in (e.get("labels") or {}).items()},
            value=None if e.get("value") is None else float(e.get("value")),
        )


def _recurring(faults: Sequence[FaultRecord], cfg: AlertConfig) -> Iterable[Alert]:
    dims = {
        "rank": lambda f: f.rank,
        "cause": lambda f: f.cause or f.kind,
        "restore_step": lambda f: f.restored_step,
    }
    for dim, get in dims.items():
        groups: dict[str, list[FaultRecord]] = {}
        for f in faults:
            value = get(f)
            if value is not None:
                groups.setdefault(str(value), []).append(f)
        for value, group in groups.items():
            group.sort(key=lambda f: f.fault_ts)
            start = 0
            fired = -1
            for j, f in enumerate(group):
                if j and f.fault_ts - group[j - 1].fault_ts > cfg.recurring_window_s:
                    start = j
                inside = [
                    g
                    for g in group[start : j + 1]
                    if f.fault_ts - g.fault_ts <= cfg.recurring_window_s
                ]
                if len(inside) >= cfg.recurring_count and fired != start:
                    fired = start
                    first = group[start]
                    yield Alert(
                        name="fault_recurring",
                        severity="page",
                        key=f"fault_recurring:{dim}={value}:{first.fault_ts:.3f}",
                        summary=(
                            f"{len(inside)} faults with {dim} {value} within "
                            f"{cfg.recurring_window_s:g} s: it keeps coming back"
                        ),
                        ts=f.fault_ts,
                        labels={dim: value, "cause": str(f.cause or f.kind)},
                        value=float(len(inside)),
                    )


def restart_budget(events: Iterable[Event] | EventIndex) -> tuple[int, int | None]:
    """(launcher restarts used, the launcher's --max-restarts, or None if unknown)."""
    index = EventIndex.of(events)
    budget = None
    rounds = set()
    for e in index.kinds(ev.PROCESS_START, ev.RESTART_BEGIN):
        if e.rank != ev.LAUNCHER_RANK:
            continue
        if e.kind == ev.PROCESS_START and e.get("max_restarts") is not None:
            budget = int(e.get("max_restarts"))
        elif e.kind == ev.RESTART_BEGIN:
            rounds.add((e.get("round"), e.attempt))
    return len(rounds), budget


def windowed_goodput(index: EventIndex, window_s: float) -> float | None:
    """Training goodput of the records ending in the last ``window_s`` of the ledger (None while
    the run is shorter than the window)."""
    if index.t1 - index.t0 < window_s or not index.ref_steps:
        return None
    window = index.since(index.t1 - window_s)
    return compute(window).training_goodput if window else None


def evaluate(
    events: Iterable[Event] | EventIndex,
    report: RunReport,
    *,
    now: float,
    cfg: AlertConfig,
    goodput_window: float | None | bool = True,
) -> list[Alert]:
    """Every alert that holds for the run at ``now`` (epoch seconds), in a stable order.

    ``goodput_window``: the windowed training goodput if the caller has it (None: not judged
    yet), or True to compute it here (``windowed_goodput``).
    """
    index = EventIndex.of(events)
    out: list[Alert] = []
    faults = [f for f in report.faults if f.disruptive]
    for f in faults:
        if f.recovery_s is not None:
            out.append(
                Alert(
                    name="fault_recovered",
                    severity="info",
                    key=f"fault_recovered:{f.rank}:{f.fault_ts:.3f}",
                    summary=(
                        f"{f.kind} on rank {f.rank} recovered by {f.layer or 'a restart'} in "
                        f"{f.recovery_s:.2f} s, {f.steps_lost} steps lost"
                    ),
                    ts=f.fault_ts + f.recovery_s,
                    labels={"rank": str(f.rank), "cause": str(f.cause or f.kind)},
                    value=f.recovery_s,
                )
            )
    out.extend(_recurring(faults, cfg))
    steps = index.ref_steps
    high, high_ts = -1, None
    for e in steps:
        if int(e.get("step")) > high:
            high, high_ts = int(e.get("step")), e.ts
    since = [f for f in faults if high_ts is None or f.fault_ts > high_ts]
    if len(since) >= cfg.no_progress_restarts:
        out.append(
            Alert(
                name="no_progress",
                severity="page",
                key=f"no_progress:{high}",
                summary=f"{len(since)} faults and no step past {high}: restarts make no progress",
                ts=since[cfg.no_progress_restarts - 1].fault_ts,
                labels={"step": str(high)},
                value=float(len(since)),
            )
        )
    used, budget = restart_budget(index)
    if budget and used / budget >= cfg.budget_ratio:
        out.append(
            Alert(
                name="restart_budget",
                severity="warning",
                key="restart_budget",
                summary=f"{used} of {budget} launcher restarts used",
                ts=now,
                value=used / budget,
            )
        )
    out.extend(_checkpoint_alerts(index, steps, now=now, cfg=cfg))
    out.extend(_storage_alert(index, report))
    for x in report.stragglers:
        out.append(
            Alert(
                name="straggler",
                severity="warning",
                key=f"straggler:{x.rank}:{x.begin_ts:.0f}",
                summary=(
                    f"rank {x.rank} is a straggler: busy {x.busy_ratio * 100:.0f}% of its step "
                    f"time against {x.others_ratio * 100:.0f}% for the others, "
                    f"{x.end_ts - x.begin_ts:.1f} s ({x.steps} steps); every rank waits for it"
                ),
                ts=x.begin_ts,
                labels={"rank": str(x.rank)},
                value=x.busy_ratio,
            )
        )
    g = windowed_goodput(index, cfg.goodput_window_s) if goodput_window is True else goodput_window
    if isinstance(g, float) and g < cfg.min_goodput:
        start = index.t1 - cfg.goodput_window_s
        out.append(
            Alert(
                name="low_goodput",
                severity="warning",
                key=f"low_goodput:{int(start // cfg.goodput_window_s)}",
                summary=(
                    f"training goodput {g * 100:.1f}% over the last "
                    f"{cfg.goodput_window_s:g} s (threshold {cfg.min_goodput * 100:.0f}%)"
                ),
                ts=index.t1,
                value=g,
            )
        )
    return out


def _checkpoint_alerts(
    index: EventIndex, steps: Sequence[Event], *, now: float, cfg: AlertConfig
) -> Iterable[Alert]:
    ckpt = sorted(
        (e for e in index.kinds(ev.CKPT_COMMIT, ev.CKPT_SKIP, ev.CKPT_STAGE) if e.rank == 0),
        key=lambda e: e.ts,
    )
    if not ckpt:
        return  # the job does not checkpoint: nothing to miss
    commits = [e for e in ckpt if e.kind == ev.CKPT_COMMIT]
    last = commits[-1] if commits else None
    since_ts = last.ts if last is not None else min(e.begin for e in steps) if steps else None
    newer_steps = [e for e in steps if since_ts is not None and e.ts > since_ts]
    if since_ts is not None and newer_steps and now - since_ts > cfg.max_commit_age_s:
        what = "since step " + str(last.get("step")) if last is not None else "yet"
        yield Alert(
            name="no_checkpoint",
            severity="warning",
            key=f"no_checkpoint:{None if last is None else last.get('step')}",
            summary=f"no checkpoint committed {what} ({now - since_ts:.0f} s)",
            ts=since_ts + cfg.max_commit_age_s,
            value=now - since_ts,
        )
    skips: list[Event] = []
    for e in ckpt:
        if e.kind == ev.CKPT_COMMIT:
            skips = []
        elif e.kind == ev.CKPT_SKIP and not str(e.get("reason", "")).startswith(STORAGE_FAILING):
            skips.append(e)  # a save held back by failing storage: checkpoint_storage_failing
    distinct = sorted({int(e.get("step", -1)) for e in skips})
    if len(distinct) >= cfg.skipped_in_a_row:
        reason = str(skips[-1].get("reason", ""))
        yield Alert(
            name="ckpt_skipped",
            severity="warning",
            key=f"ckpt_skipped:{distinct[0]}",
            summary=f"{len(distinct)} saves skipped in a row (steps {distinct[0]}-{distinct[-1]}): {reason}",
            ts=skips[cfg.skipped_in_a_row - 1].ts,
            labels={"reason": reason.split(":")[0]},
            value=float(len(distinct)),
        )


def _storage_alert(index: EventIndex, report: RunReport) -> Iterable[Alert]:
    storage = report.storage
    if storage.failing_since is None:
        return
    begin, end = storage.intervals[-1]
    commits = index.get(ev.CKPT_COMMIT)
    newest = max(commits, key=lambda e: e.ts).get("step") if commits else None
    since = "none yet" if newest is None else f"step {newest}"
    error = (storage.last_error or "").strip().splitlines()
    n = storage.failed_saves
    yield Alert(
        name="checkpoint_storage_failing",
        severity="warning",
        key=f"checkpoint_storage_failing:{begin:.3f}",
        summary=(
            f"checkpoint storage failing: {n} save{'s' if n != 1 else ''} failed"
            + (f" (last error: {error[0][:200]})" if error else "")
            + "; training goes on from the memory tier, but a lost node loses every step since "
            f"the newest commit ({since})"
        ),
        ts=begin,
        labels={"error": error[0].split(":")[0][:60] if error else ""},
        value=end - begin,
    )
