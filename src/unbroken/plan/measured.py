"""A real run's figures as planner inputs: ``unbroken plan --from RUN``.

``RUN`` is a run directory (its ledger is read and ``ledger.goodput`` computes the report) or
the JSON ``unbroken report RUN --json`` wrote (a few KB: what ``tests/data`` stores). From the
report, with every figure as the ledger defines it:

- ``step_time_s`` = productive seconds / steps completed (the surviving steps' mean);
- ``measured_stall`` = blocking checkpoint seconds / productive seconds;
- ``startup_s`` = wall - productive - blocking saves - re-executed steps - every fault's
  downtime: the run's fixed cost (start-up, shutdown, the final checkpoint);
- ``injected``: the faults by planner kind (a SIGKILL, segfault or OOM kill is ``process``);
- per fault kind and recovering layer, the mean detection; per layer, the mean restart
  (downtime - detection - restore) and steps lost; per tier, the mean restore (the reference
  rank's ``ckpt_load`` records after a fault; a report JSON has none, so restart absorbs it).

Costs a run did not exercise keep the planner's defaults; ``sources`` says which are measured.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger import goodput, read_run
from unbroken.plan.config import DEFAULT_RESTART_S

# The ledger's layer names -> the planner's.
LAYER = {"inprocess": "inprocess", "launcher": "launcher", "orchestrator": "kubernetes"}
TIER = {"memory": "memory", "disk": "durable", "peer": "memory"}
_HANG_FIELD = {
    "inprocess": "hang_timeout_s",
    "launcher": "heartbeat_timeout_s",
    "kubernetes": "collective_timeout_s",
}


def planner_kind(fault_kind: str | None) -> str | None:
    """The planner's kind of a ledger fault kind (None: not a disruptive fault we model)."""
    k = (fault_kind or "").lower()
    if k.startswith("exception"):
        return "exception"
    if k.startswith("hang") or k in ("stall", "no_progress", "heartbeat"):
        return "hang"
    if k.startswith(("node", "machine")):
        return "node"
    if k in ("sigkill", "sigterm", "segfault", "oom-kill", "oom", "crash", "exit", "signal"):
        return "process"
    return None


@dataclass(frozen=True, kw_only=True)
class Measured:
    """A run's figures, ready for ``PlanConfig(**fields)``."""

    name: str
    steps: int
    fields: dict[str, Any]
    """PlanConfig keyword arguments measured by the run."""
    sources: list[str]
    """Which of them are measured (the rest of a plan stays default)."""
    report: dict[str, Any]
    """The run's own figures (training/infra goodput, wall), to compare with a prediction."""


def restores_after_faults(
    events: Sequence[ev.Event], rep: goodput.RunReport
) -> dict[str, list[float]]:
    """The reference rank's restore seconds after a fault, by planner tier."""
    loads: dict[str, list[float]] = defaultdict(list)
    fault_ts = [f.fault_ts for f in rep.faults if f.disruptive]
    for e in events:
        tier = TIER.get(str(e.get("tier")))
        if e.kind != ev.CKPT_LOAD or e.rank != 0 or not tier or e.dur_s is None:
            continue
        if any(e.begin >= t for t in fault_ts):  # a restore after a fault
            loads[tier].append(e.dur_s)
    return loads


def _report_and_loads(path: Path) -> tuple[dict[str, Any], dict[str, list[float]]]:
    if path.is_dir():
        result = read_run(path, fold_steps_except=0)
        if not result.events:
            raise ValueError(f"the ledger in {path} has no records; is it a run directory?")
        rep = goodput.compute(result.events, digest=result.digest)
        return rep.to_dict(), restores_after_faults(result.events, rep)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--from {path}: not a run directory nor a readable report JSON ({e}); pass a "
            "--run-dir or the file `unbroken report RUN --json PATH` wrote"
        ) from e
    if not isinstance(doc, dict) or "wall_s" not in doc or "faults" not in doc:
        raise ValueError(f"--from {path}: not an `unbroken report --json` document")
    return doc, {}


def from_report(doc: dict[str, Any], loads: dict[str, list[float]] | None = None) -> Measured:
    """The planner inputs one report (``RunReport.to_dict()``) measures."""
    loads = loads or {}
    steps = int(doc["steps_completed"])
    if steps < 1 or doc["productive_s"] <= 0:
        raise ValueError("the run completed no step: nothing to measure a step time from")
    productive = float(doc["productive_s"])
    faults = [f for f in doc["faults"] if f.get("disruptive", True)]
    downtime = sum(float(f["downtime_s"] or 0.0) for f in faults)
    badput = doc["badput_s"]
    fixed = (
        float(doc["wall_s"])
        - productive
        - float(badput.get("checkpoint_save", 0.0))
        - float(badput.get("reexecuted", 0.0))
        - downtime
    )
    restore = {t: statistics.fmean(v) for t, v in loads.items() if v}
    fields: dict[str, Any] = {
        "steps": steps,
        "step_time_s": productive / steps,
        "measured_stall": float(doc["checkpoint_save_s"]) / productive,
        "startup_s": max(0.0, fixed),
    }
    sources = list(fields)
    counts: dict[str, int] = defaultdict(int)
    detect: dict[tuple[str, str], list[float]] = defaultdict(list)
    restart: dict[str, list[float]] = defaultdict(list)
    lost: dict[str, list[float]] = defaultdict(list)
    for f in faults:
        kind = planner_kind(f.get("kind"))
        layer = LAYER.get(str(f.get("layer")))
        if kind is None or layer is None or f.get("downtime_s") is None:
            continue
        counts[kind] += 1
        d = float(f["detection_s"] or 0.0)
        r = TIER.get(str(f.get("restore_tier")), "durable")
        detect[(kind, layer)].append(d)
        restart[layer].append(max(0.0, float(f["downtime_s"]) - d - restore.get(r, 0.0)))
        lost[layer].append(float(f["steps_lost"] or 0))
    if counts:
        fields["injected"] = dict(counts)
        sources.append("injected")
    for (kind, layer), values in sorted(detect.items()):
        name = _HANG_FIELD[layer] if kind == "hang" else f"{kind}_detection_s"
        fields[name] = statistics.fmean(values)
        sources.append(name)
    if restart:
        fields["restart_s"] = dict(DEFAULT_RESTART_S) | {
            layer: statistics.fmean(v) for layer, v in restart.items()
        }
        fields["steps_lost"] = {layer: statistics.fmean(v) for layer, v in lost.items()}
        fields["restore_s"] = {"memory": restore.get("memory", 0.0)}
        fields["restore_s"]["durable"] = restore.get("durable", 0.0)
        sources += ["restart_s", "steps_lost", "restore_s"]
    return Measured(
        name=str(doc.get("run") or ""),
        steps=steps,
        fields=fields,
        sources=sources,
        report={
            "training_goodput": float(doc["training_goodput"]),
            "infra_goodput": float(doc["infra_goodput"]),
            "wall_s": float(doc["wall_s"]),
        },
    )


def load(path: str | Path) -> Measured:
    """What the run directory or report JSON at ``path`` measures."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--from {p}: no such run directory or report file")
    doc, loads = _report_and_loads(p)
    m = from_report(doc, loads)
    return Measured(
        name=m.name or p.name, steps=m.steps, fields=m.fields, sources=m.sources, report=m.report
    )


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The few fields of a report the planner reads: what ``tests/data`` stores of a run."""
    keep = (
        "run",
        "wall_s",
        "productive_s",
        "steps_completed",
        "training_goodput",
        "infra_goodput",
        "checkpoint_save_s",
        "step_time_s_median",
        "recovery_s_median",
    )
    fault_keep = ("kind", "layer", "detection_s", "downtime_s", "steps_lost", "restore_tier")
    return {
        **{k: doc[k] for k in keep},
        "badput_s": {k: round(v, 4) for k, v in doc["badput_s"].items()},
        "faults": [{k: f.get(k) for k in fault_keep} for f in doc["faults"]],
    }
