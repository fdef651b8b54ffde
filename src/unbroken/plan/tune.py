"""Intervals and hang timeouts for a job like one measured run: ``recommend``.

``job_config`` turns a run's figures (``observed``) into the planner's job: its step time,
blocking save, snapshot and note costs, the time a save takes to become durable, restores,
detection and restart costs, start-up, ranks and nodes, and a fault rate per GPU-hour (the
run's faults over its training time; with none, Llama 3's published rate stands in). Flags
the user gives override any of them. ``recommend`` then sizes, each with the goodput the
planner (``model.predict``) expects for it and for a few alternatives:

1. the durable checkpoint interval: the planner's best interval (Young/Daly, searched over
   whole steps) with every fault restored from durable storage (what a fault that takes the
   memory tier with it costs), never below the steps a save takes to become durable (one due
   sooner is skipped: an interval ``c`` below that lag saves every ``ceil(lag / c) x c``);
2. the memory snapshot interval: the most frequent whose blocking (a snapshot every ``m``
   steps, a note on the others) stays within ``snapshot_budget`` of a step; when notes alone
   exceed it, the interval the planner expects the most goodput from;
3. hang timeouts: ``timeout_factor`` x the longest duration seen (at least
   ``timeout_floor_s``) for the steady step (its progress gap) and for every phase seen; a
   hang then costs its timeout and a recovery (the run's mean, or the planner's).
"""

from __future__ import annotations

import math
import shlex
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

from unbroken.plan import measured, scenarios
from unbroken.plan.config import KINDS, PlanConfig, merge_fields
from unbroken.plan.model import (
    expected_lost,
    lag_steps,
    predict,
    restore_s,
    stall,
    young_steps,
)
from unbroken.plan.observed import RECOVERY, Observed

# The in-process calibrator's defaults (unbroken.restart.config.RestartConfig).
TIMEOUT_FACTOR = 8.0
TIMEOUT_FLOOR_S = 1.0
STEADY = "step"
# Phases in the order a run meets them; others follow by name.
PHASE_ORDER = (
    "import",
    "rendezvous",
    "pg_init",
    "model_build",
    "restore",
    "data",
    "save",
    "persist",
    "validation",
    "recovery",
    "shutdown",
)
ENV_CKPT_EVERY = "UNBROKEN_CKPT_EVERY"
ENV_SNAPSHOT_EVERY = "UNBROKEN_SNAPSHOT_EVERY"
ENV_SOFT_TIMEOUT = "UNBROKEN_SOFT_TIMEOUT_S"
ENV_PHASE_TIMEOUTS = "UNBROKEN_PHASE_TIMEOUTS"
_LEDGER_TIER = {"disk": "durable", "memory": "memory", "peer": "memory"}
_LAYERING = {"inprocess": "inprocess", "launcher": "launcher", "orchestrator": "kubernetes"}
_EPS_S = 1e-6  # a cost measured as 0 (a clock tick): the planner needs a positive bandwidth


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """How recommendations are sized from the measured figures."""

    timeout_factor: float = TIMEOUT_FACTOR
    """A hang timeout is this many times the longest duration seen of its phase."""
    timeout_floor_s: float = TIMEOUT_FLOOR_S
    """No hang timeout below this many seconds."""
    snapshot_budget: float = 0.01
    """Snapshots and notes may block at most this fraction of a step."""

    def __post_init__(self) -> None:
        if not self.timeout_factor > 1:
            raise ValueError(f"timeout_factor must be > 1, got {self.timeout_factor!r}")
        if not self.timeout_floor_s > 0:
            raise ValueError(f"timeout_floor_s must be > 0, got {self.timeout_floor_s!r}")
        if not 0 < self.snapshot_budget < 1:
            raise ValueError(f"snapshot_budget must lie in (0, 1), got {self.snapshot_budget!r}")


@dataclass(frozen=True, kw_only=True)
class Job:
    """The planner's job sized on a run, and where its fault rate comes from."""

    config: PlanConfig
    layering: str
    """The layering that recovered the run's faults (``inprocess`` when it had none)."""
    rate_source: str
    """One sentence: the fault rate used and why."""


def _layering(obs: Observed) -> str:
    layers = {str(f.layer) for f in obs.faults}
    for layer in ("inprocess", "launcher", "orchestrator"):
        if layer in layers:
            return _LAYERING[layer]
    return "inprocess"


def job_config(obs: Observed, given: dict[str, Any] | None = None) -> Job:
    """The planner's job for ``obs``; ``given``: PlanConfig fields the user set (they win)."""
    given = dict(given or {})
    fields = {
        k: v
        for k, v in obs.planner.fields.items()
        if k not in ("steps", "measured_stall", "steps_lost", "injected", "restore_s")
    }
    step_s = obs.step_s.median or obs.report.step_time_s_median or 0.0
    fields["step_time_s"] = max(step_s, _EPS_S)
    fields["nodes"] = obs.nodes
    fields["gpus_per_node"] = max(1, obs.world_size // obs.nodes)
    fields["note_s"] = obs.note_s.median or 0.0
    snapshot = obs.snapshot_s.median or obs.save_s.median or _EPS_S
    if obs.save_s.count:
        fields["save_stage_s"] = obs.save_s.median
    restores: dict[str, list[float]] = {}
    for tier, d in obs.restore_s.items():
        restores.setdefault(_LEDGER_TIER.get(tier, "durable"), []).extend(d.values)
    fields["restore_s"] = {t: statistics.median(v) for t, v in restores.items()}
    gpus = fields["nodes"] * fields["gpus_per_node"]
    counts = Counter(measured.planner_kind(f.kind) for f in obs.faults)
    counts.pop(None, None)
    hours = obs.train_s / 3600.0
    if "failures_per_gpu_hour" in given or "injected" in given:
        source = "as given by the flags"
    elif counts and hours > 0:
        fields["failures_per_gpu_hour"] = {k: n / (gpus * hours) for k, n in counts.items()}
        n = sum(counts.values())
        source = (
            f"the run's: {n} fault(s) in {obs.train_s:.1f} s of training; give "
            "--failures-per-gpu-hour KIND=RATE (or --llama3) for production's"
        )
    else:
        fields["failures_per_gpu_hour"] = {
            k: scenarios.LLAMA3_RATE * share for k, share in scenarios.LLAMA3_SHARES.items()
        }
        source = (
            "the run had no fault: Llama 3's published rate stands in; give "
            "--failures-per-gpu-hour KIND=RATE for yours"
        )
    fields = merge_fields(fields, given)  # as ``plan --from`` merges flags
    gpus = fields["nodes"] * fields["gpus_per_node"]
    shard = obs.shard_bytes or PlanConfig().shard_bytes
    # Sizes chosen so the planner's derived times are the measured ones at any job size.
    fields.setdefault("state_bytes", shard * gpus)
    per_gpu = fields["state_bytes"] / gpus
    fields.setdefault("stage_bytes_per_s", per_gpu / snapshot)
    durable_s = obs.durable_lag_s.max or obs.persist_s.max
    if durable_s:
        fields.setdefault("storage_bytes_per_s", fields["state_bytes"] / max(durable_s, _EPS_S))
    return Job(config=PlanConfig(**fields), layering=_layering(obs), rate_source=source)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One interval and what the planner expects of it."""

    every: int
    """Steps between saves (or snapshots) as configured."""
    effective: int
    """Steps between the saves that happen (due saves skipped while one persists)."""
    blocking_s_per_step: float
    """Seconds a step is blocked by checkpointing, on average."""
    lost_steps: float
    """Steps a fault rolls back on average."""
    goodput: float | None
    """Expected training goodput; None: faults undo the work faster than it is done."""
    goodput_memory_tier: float | None = None
    """Durable intervals: the same with the memory tier restoring what it holds."""


@dataclass(frozen=True, kw_only=True)
class Timeout:
    """A recommended hang timeout."""

    name: str
    """``step`` (the steady progress gap) or a phase's name."""
    count: int
    longest_s: float
    timeout_s: float
    hang_cost_s: float
    """What a hang there costs: the timeout, then a recovery."""


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """What ``recommend`` found; ``env`` applies it."""

    layering: str
    rate_source: str
    mtbf_s: float | None
    ckpt_every: int
    ckpt_choices: tuple[Choice, ...]
    ckpt_why: str
    snapshot_every: int
    snapshot_choices: tuple[Choice, ...]
    snapshot_why: str
    timeouts: tuple[Timeout, ...]
    timeouts_why: str
    env: dict[str, str]

    def env_line(self) -> str:
        """The environment as one ``export`` line a shell takes."""
        return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["env_line"] = self.env_line()
        return out


def _goodput(cfg: PlanConfig, layering: str) -> float | None:
    try:
        return predict(cfg, layering).training_goodput
    except ValueError:  # the job never finishes at this interval
        return None


def effective(every: int, lag: int) -> int:
    """The interval saves really have when one is due every ``every`` steps and a save takes
    ``lag`` steps to be durable (a save due sooner is skipped)."""
    return every if every >= lag else math.ceil(lag / every) * every


def _candidates(best: int, *extra: int | None, top: int | None = None) -> list[int]:
    out = {best, max(1, best // 4), max(1, best // 2), 2 * best, 4 * best}
    out |= {e for e in extra if e}
    return sorted(c for c in out if c >= 1 and (top is None or c <= top))


def _on_disk(cfg: PlanConfig) -> PlanConfig:
    """``cfg`` with every fault restored from durable storage (the memory tier lost)."""
    return replace(cfg, memory_tier=False, ckpt_every_steps=None, memory_every_steps=None)


def _durable(job: Job, obs: Observed, best: int, m_for: int) -> tuple[list[Choice], str]:
    cfg, layering = job.config, job.layering
    disk = _on_disk(cfg)
    lag = lag_steps(cfg)
    rows = []
    for c in _candidates(best, obs.ckpt_every, lag):
        eff = effective(c, lag)
        on_disk = replace(disk, ckpt_every_steps=eff)
        with_memory = replace(cfg, ckpt_every_steps=eff, memory_every_steps=min(m_for, eff))
        rows.append(
            Choice(
                every=c,
                effective=eff,
                blocking_s_per_step=cfg.step_time_s
                * stall(_plain(layering), k=eff, m=eff, cfg=on_disk),
                lost_steps=expected_lost("durable", k=eff, m=eff, cfg=cfg) + 0.5,
                goodput=_goodput(on_disk, layering),
                goodput_memory_tier=_goodput(with_memory, layering),
            )
        )
    young = young_steps(disk)
    durable_s = lag * cfg.step_time_s
    why = (
        f"Young/Daly gives {young:,.0f} steps for a {_ms(cfg.save_stage_s or cfg.stage_s)} "
        f"save and a fault every {_dur(_mtbf(cfg))}; the planner's best over whole steps, "
        f"every fault restored from disk, is {best}. A save is durable {_dur(cfg.persist_s)} "
        f"after it (the slowest seen) = {lag} steps: an interval below {lag} skips saves"
    )
    if not (obs.durable_lag_s.count or obs.persist_s.count):
        why += " (no save became durable in the run: the lag is the planner's, from sizes)"
    if obs.ckpt_every and obs.ckpt_every < lag:
        why += (
            f" (the run's every {obs.ckpt_every} saved every "
            f"{effective(obs.ckpt_every, lag)}; it skipped {obs.skipped_saves})"
        )
    why += (
        ". With the memory tier a fault restores from memory: the durable interval only "
        "bounds what a fault that loses the memory tier costs (the lag, "
        f"{_dur(durable_s)}, and half an interval of steps)"
    )
    return rows, why


def _blocking(cfg: PlanConfig, m: int) -> float:
    """Seconds per step a snapshot every ``m`` steps and a note on the others block."""
    return cfg.stage_s / m + cfg.note_s * (1 - 1 / m)


def _snapshot(job: Job, obs: Observed, k: int, tune: TuneConfig) -> tuple[int, list[Choice], str]:
    cfg, layering = job.config, job.layering
    budget = tune.snapshot_budget * cfg.step_time_s
    stage, note = cfg.stage_s, cfg.note_s
    m = 0
    tol = 1e-9  # measured seconds are sums of clock readings: 3 ms / 1 ms may be 3.0000001
    if stage <= budget * (1 + tol):
        m = 1
    elif note < budget:
        m = min(k, math.ceil((stage - note) / (budget - note) - tol))
    met = m > 0 and _blocking(cfg, m) <= budget * (1 + tol)
    if not met:
        pool = sorted({1, 2, 4, 8, 16, 32, k} & set(range(1, k + 1)))
        m = max(pool, key=lambda c: (_goodput(_at(cfg, k, c), layering) or 0.0, -c))

    def row(c: int) -> Choice:
        return Choice(
            every=c,
            effective=c,
            blocking_s_per_step=_blocking(cfg, c),
            lost_steps=expected_lost("memory", k=k, m=c, cfg=cfg) + 0.5,
            goodput=_goodput(_at(cfg, k, c), layering),
        )

    rows = [row(c) for c in _candidates(m, 1, obs.snapshot_every, top=k)]
    pct = 100 * _blocking(cfg, m) / cfg.step_time_s
    why = f"a snapshot blocks {_ms(stage)}"
    why += (
        f", a note {_ms(note)}" if obs.note_s.count else " (the run noted no step: notes count 0)"
    )
    why += f", a step computes {_dur(cfg.step_time_s)}; every {m} blocks {pct:.2f}% of a step"
    if met:
        why += f" (budget {100 * tune.snapshot_budget:g}%)"
        if m > 1:
            why += (
                f", every {m - 1} would block {100 * _blocking(cfg, m - 1) / cfg.step_time_s:.2f}%"
            )
    else:
        why += (
            f": notes alone exceed the {100 * tune.snapshot_budget:g}% budget, so the interval "
            "the planner expects the most goodput from (or turn the rescue notes off)"
        )
    lost = expected_lost("memory", k=k, m=m, cfg=cfg) + 0.5
    why += f"; a fault restored from memory rolls back ~{_count(lost)} steps"
    by_goodput = predict(replace(cfg, ckpt_every_steps=k), layering).memory_every_steps
    if met and by_goodput and by_goodput != m:
        why += (
            f". At this fault rate the planner's goodput alone would snapshot every "
            f"{by_goodput} (~{_count(expected_lost('memory', k=k, m=by_goodput, cfg=cfg) + 0.5)} "
            "steps rolled back): the budget keeps the rollback short for a bounded cost"
        )
    return m, rows, why


def _at(cfg: PlanConfig, k: int, m: int) -> PlanConfig:
    return replace(cfg, ckpt_every_steps=k, memory_every_steps=m)


def _timeouts(job: Job, obs: Observed, tune: TuneConfig) -> tuple[list[Timeout], str]:
    cfg = job.config
    recovered = obs.phases.get(RECOVERY)
    if recovered and recovered.values:
        recovery_s = statistics.fmean(recovered.values)
        basis = f"the run's mean recovery, {_dur(recovery_s)}"
    else:
        layer = "inprocess" if job.layering == "inprocess" else "launcher"
        recovery_s = cfg.restart_s[layer] + restore_s("memory", cfg)
        basis = f"the planner's {layer} restart and memory restore, {_dur(recovery_s)}"
    seen = {STEADY: obs.gap_s} | {
        n: d for n, d in obs.phases.items() if d.count and d.max is not None
    }
    order = {n: i for i, n in enumerate((STEADY, *PHASE_ORDER))}
    rows = []
    for name in sorted(seen, key=lambda n: (order.get(n, len(order)), n)):
        d = seen[name]
        if d.max is None:
            continue
        t = _round_up(max(tune.timeout_floor_s, tune.timeout_factor * d.max))
        rows.append(
            Timeout(
                name=name,
                count=d.count,
                longest_s=d.max,
                timeout_s=t,
                hang_cost_s=t + recovery_s,
            )
        )
    why = (
        f"{tune.timeout_factor:g} x the longest seen, at least {_dur(tune.timeout_floor_s)}; a "
        f"hang costs its timeout and a recovery ({basis})"
    )
    if obs.first_step_s.count:
        why += (
            f". Each start's first step (up to {_dur(obs.first_step_s.max or 0.0)} here) is the "
            "initial timeout's, not the steady one's"
        )
    return rows, why


def _env(k: int, m: int, timeouts: list[Timeout]) -> dict[str, str]:
    env = {ENV_CKPT_EVERY: str(k), ENV_SNAPSHOT_EVERY: str(m)}
    phases = []
    for t in timeouts:
        if t.name == STEADY:
            env[ENV_SOFT_TIMEOUT] = f"{t.timeout_s:g}"
        elif not any(c in t.name for c in ",= \t\n"):  # a name the list cannot carry is left out
            phases.append(f"{t.name}={t.timeout_s:g}")
    if phases:
        env[ENV_PHASE_TIMEOUTS] = ",".join(phases)
    return env


def recommend(obs: Observed, job: Job, tune: TuneConfig | None = None) -> Recommendation:
    """Durable and snapshot intervals and hang timeouts for ``job`` (sized on ``obs``)."""
    tune = tune or TuneConfig()
    cfg, layering = job.config, job.layering
    k = predict(_on_disk(cfg), _plain(layering)).ckpt_every_steps
    m, snapshot_rows, snapshot_why = _snapshot(job, obs, k, tune)
    ckpt_rows, ckpt_why = _durable(job, obs, k, m)
    timeouts, timeouts_why = _timeouts(job, obs, tune)
    return Recommendation(
        layering=layering,
        rate_source=job.rate_source,
        mtbf_s=_mtbf(cfg),
        ckpt_every=k,
        ckpt_choices=tuple(ckpt_rows),
        ckpt_why=ckpt_why,
        snapshot_every=min(m, k),
        snapshot_choices=tuple(snapshot_rows),
        snapshot_why=snapshot_why,
        timeouts=tuple(timeouts),
        timeouts_why=timeouts_why,
        env=_env(k, min(m, k), timeouts),
    )


def _plain(layering: str) -> str:
    return "inprocess" if layering == "kubernetes" else layering


def _mtbf(cfg: PlanConfig) -> float | None:
    if cfg.injected:
        n = sum(cfg.injected.values())
        return cfg.productive_s / n if n else None
    rate = sum(cfg.rate_per_s(kind) for kind in KINDS)
    return 1.0 / rate if rate > 0 else None


def _round_up(x: float) -> float:
    """Up to a tenth below 10 s, a whole second above (a timeout is never rounded down)."""
    return math.ceil(x * 10 - 1e-9) / 10 if x < 10 else float(math.ceil(x - 1e-9))


def _count(x: float) -> str:
    return f"{x:.2g}" if x < 100 else f"{x:,.0f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def _dur(s: float | None) -> str:
    if s is None:
        return "never"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 600:
        return f"{s:.3g} s"
    if s < 3 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:,.0f} days"
