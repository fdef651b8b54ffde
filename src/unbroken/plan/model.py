"""The analytical model: expected training and infrastructure goodput of one layering.

The job does ``steps`` steps of ``step_time_s``; the productive time ``P`` is fixed. Wall time:

    W = startup_s + T_train + sum over kinds of N_k * D_k
    T_train = P * (1 + stall) * (1 + other_overhead) + sum over kinds of N_k * R_k

- ``stall``: blocking checkpoint time per second of steps: a memory-tier snapshot costs one
  copy of a shard into host memory (``stage_s``) every ``m <= k`` steps, and every other step
  a note (``note_s``); an asynchronous durable save every ``k`` steps persists such a snapshot
  (or costs ``save_stage_s`` when measured, with or without a memory tier); a synchronous one
  stalls for the whole write through the shared bandwidth;
- per fault of kind k, recovered by a layer (``handler``): ``D_k`` = detection + restart +
  restore (the job is down) and ``R_k`` = rolled-back steps re-executed (training time);
  rolled back: ``(m - 1) / 2`` steps from a memory snapshot, ``(k - 1) / 2 + lag`` from a
  durable one, ``lag`` the steps an async save takes to become durable; a production fault
  strikes mid-step and loses half a step more;
- ``N_k``: the injected count, or rate x ``T_train`` (faults strike while the job trains;
  one striking during a recovery is not modelled);
- training goodput = P / W; infrastructure goodput = 1 - sum N_k * (restart + restore) / W
  (the ledger's definition: from detection to training again).

Best intervals: ``k`` and ``m`` minimise stall + expected re-executed time per second (Young's
rule, sqrt(2 x save cost x MTBF), searched over whole steps); an async durable save cannot be
more frequent than its write (``persist_s``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.plan.config import KINDS, LAYERINGS, PlanConfig


def handler(kind: str, layering: str, *, spare: bool) -> str:
    """The layer that recovers a fault of ``kind`` under ``layering``."""
    if layering == "kubernetes":
        return "kubernetes"
    if kind == "node":
        return "spare" if spare else "kubernetes"
    if layering == "inprocess" and kind in ("exception", "hang"):
        return "inprocess"
    return "launcher"


def tier(layer: str, layering: str, cfg: PlanConfig) -> str:
    """Where a restore after a fault recovered by ``layer`` reads from."""
    if layering == "kubernetes" or not cfg.memory_tier:
        return "durable"
    return "memory"  # local snapshot (in-process, launcher) or the peer's copy (a lost node)


def detection_s(kind: str, layer: str, cfg: PlanConfig) -> float:
    if kind == "exception":
        return cfg.exception_detection_s
    if kind == "process":
        return cfg.process_detection_s
    if kind == "node":
        return cfg.node_detection_s
    return {
        "inprocess": cfg.hang_timeout_s,
        "launcher": cfg.heartbeat_timeout_s,
    }.get(layer, cfg.collective_timeout_s)


def restore_s(t: str, cfg: PlanConfig) -> float:
    if t in cfg.restore_s:
        return cfg.restore_s[t]
    if t == "memory":
        return cfg.stage_s
    return cfg.shard_bytes / (cfg.storage_bytes_per_s / cfg.gpus)


def lag_steps(cfg: PlanConfig) -> int:
    """Steps an async durable save takes to become durable (0 when synchronous)."""
    return math.ceil(cfg.persist_s / cfg.step_time_s) if cfg.async_checkpoint else 0


def expected_lost(t: str, *, k: int, m: int, cfg: PlanConfig) -> float:
    """Expected steps rolled back when restoring from tier ``t`` (without a partial step)."""
    if t == "memory":
        return (min(m, k) - 1) / 2  # a durable save is a memory snapshot too
    return (k - 1) / 2 + min(lag_steps(cfg), k)


def stall(layering: str, *, k: int, m: int, cfg: PlanConfig) -> float:
    """Blocking checkpoint seconds per second of steps."""
    if cfg.measured_stall is not None:
        return cfg.measured_stall
    per_step = 0.0
    memory = cfg.memory_tier and layering != "kubernetes"
    save = cfg.stage_s if cfg.save_stage_s is None else cfg.save_stage_s
    if memory:
        every = min(m, k)
        per_step += cfg.stage_s / every + cfg.note_s * (1 - 1 / every)
        if cfg.async_checkpoint:  # an async durable save stages in place of a snapshot
            per_step += (save - cfg.stage_s) / k
    if not cfg.async_checkpoint:
        per_step += cfg.persist_s / k
    elif not memory:
        per_step += save / k
    return per_step / cfg.step_time_s


def spare_fraction(cfg: PlanConfig, spares: int) -> float:
    """Fraction of node losses for which a spare is ready (Poisson over the repair time)."""
    if spares <= 0:
        return 0.0
    mean = cfg.rate_per_s("node") * cfg.node_repair_s
    if cfg.injected:
        return 1.0 if spares >= cfg.injected.get("node", 0) else spares / cfg.injected["node"]
    return _poisson_cdf(spares - 1, mean)


def _poisson_cdf(k: int, mean: float) -> float:
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return min(1.0, total)


def recommended_spares(cfg: PlanConfig) -> int:
    """Fewest spares that are ready for ``spare_target`` of node losses."""
    if cfg.injected:
        return cfg.injected.get("node", 0)
    if cfg.rate_per_s("node") == 0:
        return 0
    s = 1
    while spare_fraction(cfg, s) < cfg.spare_target and s < 10_000:
        s += 1
    return s


@dataclass(frozen=True, kw_only=True)
class FaultCost:
    """What one fault of a kind costs under a layering (expected values)."""

    kind: str
    layer: str
    tier: str
    count: float
    """Expected faults of this kind in the run."""
    detection_s: float
    restart_s: float
    restore_s: float
    steps_lost: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The analytical expectation for one layering."""

    layering: str
    """One of ``LAYERINGS``."""
    wall_s: float
    """Expected wall time of the job."""
    training_goodput: float
    """Expected productive seconds / wall seconds."""
    infra_goodput: float
    """Expected 1 - (restart and restore seconds) / wall seconds."""
    faults: float
    """Expected faults in the run."""
    ckpt_every_steps: int
    """The durable checkpoint interval, in steps (configured, else the best)."""
    memory_every_steps: int | None
    """The memory snapshot interval, in steps (None: no memory tier)."""
    stall: float
    """Blocking checkpoint seconds per second of steps."""
    hot_spares: int
    """Hot spare nodes (configured, else recommended; 0 for Kubernetes alone)."""
    memory_tier_bytes_per_node: float
    """Host memory of the memory tier on each node: a local snapshot and a peer's copy."""
    costs: tuple[FaultCost, ...]
    """Per fault kind and recovering layer: how many, and what each costs."""

    def to_dict(self) -> dict[str, Any]:
        """The prediction as plain data (``unbroken plan --json``).

        Returns:
            Field name -> value, the costs as dicts.
        """
        out = asdict(self)
        out["costs"] = [asdict(c) for c in self.costs]
        return out


def _lost(t: str, layer: str, *, k: int, m: int, cfg: PlanConfig) -> float:
    if layer in cfg.steps_lost:
        return cfg.steps_lost[layer]
    partial = 0.0 if cfg.injected else 0.5
    return expected_lost(t, k=k, m=m, cfg=cfg) + partial


def fault_costs(layering: str, *, k: int, m: int, spares: int, cfg: PlanConfig) -> list[FaultCost]:
    """Per kind (and, for a node loss, per spare-or-not) the cost of one fault."""
    out = []
    ready = spare_fraction(cfg, spares) if layering != "kubernetes" else 0.0
    for kind in KINDS:
        share = [(True, ready), (False, 1.0 - ready)] if kind == "node" else [(False, 1.0)]
        for spare, weight in share:
            if weight <= 0:
                continue
            layer = handler(kind, layering, spare=spare)
            t = tier(layer, layering, cfg)
            count = cfg.injected.get(kind, 0) if cfg.injected else cfg.rate_per_s(kind)
            out.append(
                FaultCost(
                    kind=kind,
                    layer=layer,
                    tier=t,
                    count=count * weight,
                    detection_s=detection_s(kind, layer, cfg),
                    restart_s=cfg.restart_s[layer],
                    restore_s=restore_s(t, cfg),
                    steps_lost=_lost(t, layer, k=k, m=m, cfg=cfg),
                )
            )
    return out


def _overhead(layering: str, k: int, m: int, spares: int, cfg: PlanConfig) -> float:
    """Stall plus expected re-executed time per second of steps (what the intervals trade)."""
    costs = fault_costs(layering, k=k, m=m, spares=spares, cfg=cfg)
    rate = 0.0 if cfg.injected else 1.0
    lost = sum(c.count * c.steps_lost for c in costs) * cfg.step_time_s
    if cfg.injected:
        rate = 1.0 / cfg.productive_s
    return stall(layering, k=k, m=m, cfg=cfg) + rate * lost


def _search(f: Any, low: int, guess: float) -> int:
    """The whole number >= low minimising f near Young's ``guess`` (f is unimodal)."""
    lo = max(low, 1)
    hi = max(lo, int(guess * 8) + 2)
    candidates = {lo, hi}
    x = float(lo)
    while x <= hi:
        candidates.add(int(x))
        x = x * 1.05 + 1
    best = min(candidates, key=lambda c: (f(c), c))
    for c in range(max(lo, best - 30), best + 31):  # refine among whole steps
        if f(c) < f(best):
            best = c
    return best


def intervals(layering: str, cfg: PlanConfig, spares: int) -> tuple[int, int]:
    """(durable k, memory m) in steps: the configured ones, else the best."""
    lag = lag_steps(cfg)
    min_k = lag if cfg.async_checkpoint else 1
    memory = cfg.memory_tier and layering != "kubernetes"
    young = young_steps(cfg)
    if cfg.ckpt_every_steps is not None:
        k = cfg.ckpt_every_steps
    else:  # first with every durable save the only snapshot, then trade the two
        k = _search(lambda c: _overhead(layering, c, c, spares, cfg), min_k, young)
    m = cfg.memory_every_steps or k
    for _ in range(3 if memory else 0):
        if cfg.memory_every_steps is None:
            m = _search(lambda c, k=k: _overhead(layering, k, c, spares, cfg), 1, young)
        if cfg.ckpt_every_steps is None:
            k = _search(lambda c, m=m: _overhead(layering, c, m, spares, cfg), max(min_k, m), young)
    return k, min(m, k)


def young_steps(cfg: PlanConfig) -> float:
    """Young's interval in steps for the blocking cost of a save and the job's MTBF."""
    rate = sum(cfg.rate_per_s(kind) for kind in KINDS)
    if cfg.injected:
        rate = sum(cfg.injected.values()) / cfg.productive_s
    save = cfg.stage_s if cfg.save_stage_s is None else cfg.save_stage_s
    cost = save if cfg.async_checkpoint else cfg.persist_s
    if rate <= 0:
        return float(cfg.steps)
    return math.sqrt(2 * cost / rate) / cfg.step_time_s


def predict(cfg: PlanConfig, layering: str) -> Prediction:
    """The expected figures of a job under one layering.

    Args:
        cfg: The job.
        layering: One of ``LAYERINGS``.

    Returns:
        The expectation.

    Raises:
        ValueError: For an unknown layering, or when faults (rate mode) undo the work faster
            than it is done.
    """
    if layering not in LAYERINGS:
        raise ValueError(f"unknown layering {layering!r}; expected one of {list(LAYERINGS)}")
    spares = recommended_spares(cfg) if cfg.hot_spares is None else cfg.hot_spares
    if layering == "kubernetes":
        spares = 0
    k, m = intervals(layering, cfg, spares)
    s = stall(layering, k=k, m=m, cfg=cfg)
    costs = fault_costs(layering, k=k, m=m, spares=spares, cfg=cfg)
    base = cfg.productive_s * (1 + s) * (1 + cfg.other_overhead)
    step_wall = cfg.step_time_s * (1 + s) * (1 + cfg.other_overhead)
    if cfg.injected:
        train = base + sum(c.count * c.steps_lost * step_wall for c in costs)
        counts = [c.count for c in costs]
    else:
        redo = sum(c.count * c.steps_lost * step_wall for c in costs)  # per second of training
        if redo >= 1:
            raise ValueError(
                f"under {layering}, faults roll back {redo:.2f} s of work per second of "
                "training: the job never finishes; lower the failure rates or the interval"
            )
        train = base / (1 - redo)
        counts = [c.count * train for c in costs]
    down = sum(
        n * (c.detection_s + c.restart_s + c.restore_s) for n, c in zip(counts, costs, strict=True)
    )
    infra = sum(n * (c.restart_s + c.restore_s) for n, c in zip(counts, costs, strict=True))
    wall = cfg.startup_s + train + down
    memory = cfg.memory_tier and layering != "kubernetes"
    return Prediction(
        layering=layering,
        wall_s=wall,
        training_goodput=cfg.productive_s / wall,
        infra_goodput=1 - infra / wall,
        faults=sum(counts),
        ckpt_every_steps=k,
        memory_every_steps=m if memory else None,
        stall=s,
        hot_spares=spares,
        memory_tier_bytes_per_node=cfg.memory_tier_bytes_per_node if memory else 0.0,
        costs=tuple(
            FaultCost(**{**asdict(c), "count": n}) for n, c in zip(counts, costs, strict=True)
        ),
    )
