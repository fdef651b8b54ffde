"""``unbroken bench recovery``'s results: one row per configuration, the table, the gaps.

A configuration's *gap* is how many points of training goodput it gives up against its
fault-free reference: its twin ``<config>-nofault`` (the same configuration without the fault
plan, when that ran) or else ``clean``. The twin isolates what the faults cost; against
``clean`` the gap also holds what being ready for them costs (the memory snapshots) and the
runs' other differences (clean's ranks are one-rank pods, like the baseline's).

With ``--repeat N`` every configuration but clean runs N times, round-robin (each run's gap is
taken against its twin of the same round), and ``format_summary`` gives each figure's median
and range over the rounds: two runs of one configuration on a shared machine may differ by
more than a goal's margin (the twins' step times too), so a goal is judged on the median.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from unbroken.ledger.html import RunView

NO_FAULTS = "-nofault"
"""Suffix of a configuration's fault-free twin."""


@dataclass
class ConfigResult:
    """One configuration's figures (the JSON row)."""

    config: str
    label: str
    returncode: int
    figures: dict[str, Any] = field(default_factory=dict)
    view: RunView | None = None
    """The run's events and report, for the HTML page (None when it left no ledger)."""
    final_state_sha256: str | None = None
    matches_clean: bool | None = None
    reference: str | None = None
    """The fault-free run its gap is taken against (``set_gaps``)."""
    gap: float | None = None
    """Its training goodput below the reference's, a share (``set_gaps``)."""
    run: int = 1
    """Which round of ``--repeat`` this is (1 for the first)."""
    final_digest: str | None = None
    """The final state as the run's Checkpointers recorded it (``judge.ledger_digest``)."""
    hash_source: str = "printed"
    """Where ``final_state_sha256`` came from: "printed" (or final.json) or "digest"."""
    verdict: str = ""
    """The correctness column: "yes"/"NO" (by hash), "loss 98%"/"LOSS 60%" (by loss curve),
    "unchecked" (``unbroken.bench.judge``)."""
    judged_by: str | None = None
    """"hash", "loss" or "none"."""
    loss_within: float | None = None
    """By loss: the share of steps within the fault-free runs' spread."""

    @property
    def name(self) -> str:
        """The run's name: its directory, log and knowledge-base name (``<config>.run<k>``
        from the second round on)."""
        return self.config if self.run == 1 else f"{self.config}.run{self.run}"

    def row(self) -> dict[str, Any]:
        f = self.figures
        return {
            "config": self.config,
            "run": self.run,
            "label": self.label,
            "returncode": self.returncode,
            "training_goodput": f.get("training_goodput"),
            "infra_goodput": f.get("infra_goodput"),
            "availability": f.get("availability"),
            "recovery_s": [x["recovery_s"] for x in f.get("faults", [])],
            "steps_lost": [x["steps_lost"] for x in f.get("faults", [])],
            "detection_s": [x["detection_s"] for x in f.get("faults", [])],
            "wall_s": f.get("wall_s"),
            "checkpoint_efficiency": f.get("checkpoint_efficiency"),
            "fault_cost": _fraction(f, f.get("fault_s")),
            "checkpoint_cost": _fraction(f, (f.get("badput_s") or {}).get("checkpoint_save")),
            "step_time_s_median": f.get("step_time_s_median"),
            "ettr": f.get("ettr"),
            "reference": self.reference,
            "goodput_gap": self.gap,
            "final_state_sha256": self.final_state_sha256,
            "matches_clean": self.matches_clean,
            "hash_source": self.hash_source,
            "judged_by": self.judged_by,
            "loss_within": self.loss_within,
            "by_class": f.get("by_class", {}),
            "by_phase": f.get("by_phase", {}),
        }


def set_gaps(results: list[ConfigResult]) -> None:
    """Give every run with faults its reference and gap (see the module docstring)."""
    by_name = {(r.config, r.run): r for r in results}
    for r in results:
        if r.config == "clean" or r.config.endswith(NO_FAULTS):
            continue
        ref = by_name.get((r.config + NO_FAULTS, r.run)) or by_name.get(("clean", 1))
        mine = r.figures.get("training_goodput")
        theirs = None if ref is None else ref.figures.get("training_goodput")
        if ref is not None and mine is not None and theirs is not None:
            r.reference, r.gap = ref.name, float(theirs) - float(mine)


def _fraction(figures: dict[str, Any], seconds: float | None) -> float | None:
    """``seconds`` as a share of the run's wall time (None without either)."""
    wall = figures.get("wall_s")
    return None if seconds is None or not wall else float(seconds) / float(wall)


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _points(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.1f}"


def _num(xs: list[Any]) -> str:
    vals = [x for x in xs if x is not None]
    if not vals:
        return "–"
    return f"{statistics.median(vals):.2f}/{max(vals):.2f}"


def _verdict(r: ConfigResult) -> str:
    if r.verdict:
        return r.verdict
    return "yes" if r.matches_clean else "NO"


def format_table(results: list[ConfigResult]) -> str:
    w = max([12, *(len(r.name) for r in results)])
    head = (
        f"{'config':<{w}} {'train goodput':>13} {'gap':>6} {'infra goodput':>13} {'avail':>6} "
        f"{'recovery s p50/max':>19} "
        f"{'steps lost':>12} {'detect s p50':>12} {'ckpt eff':>9} {'faults':>7} {'ckpt':>6} "
        f"{'step ms':>8} {'ETTR':>7} {'wall s':>8} {'= clean':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        row = r.row()
        lost = [x for x in row["steps_lost"] if x is not None]
        det = [x for x in row["detection_s"] if x is not None]
        lines.append(
            f"{r.name:<{w}} {pct(row['training_goodput']):>13} {_points(r.gap):>6} "
            f"{pct(row['infra_goodput']):>13} "
            f"{pct(row['availability']):>6} {_num(row['recovery_s']):>19} {(str(sum(lost)) if lost else '–'):>12} "
            f"{(f'{statistics.median(det):.3f}' if det else '–'):>12} "
            f"{pct(row['checkpoint_efficiency']):>9} {pct(row['fault_cost']):>7} "
            f"{pct(row['checkpoint_cost']):>6} {_ms(row['step_time_s_median']):>8} "
            f"{pct(row['ettr']):>7} "
            f"{(row['wall_s'] or 0):>8.1f} {_verdict(r):>9}"
        )
    refs = sorted({f"{r.name} against {r.reference}" for r in results if r.reference})
    if refs:
        lines.append(
            f"gap: points of training goodput below the fault-free run ({'; '.join(refs)})"
        )
    return "\n".join(lines)


SUMMARY = (
    ("training goodput", "training_goodput", pct),
    ("gap", "goodput_gap", _points),
    ("fault cost", "fault_cost", _points),
    ("infra goodput", "infra_goodput", lambda x: "–" if x is None else f"{100 * x:.2f}%"),
)
"""The figures ``format_summary`` gives a median and range of: (heading, row key, format)."""


def summarize(results: list[ConfigResult]) -> list[dict[str, Any]]:
    """Per configuration that ran more than once: each SUMMARY figure's median, low and high
    over its runs, how many runs, and whether every one matched clean."""
    out = []
    for config in dict.fromkeys(r.config for r in results):
        runs = [r for r in results if r.config == config]
        if len(runs) < 2:
            continue
        doc: dict[str, Any] = {
            "config": config,
            "runs": len(runs),
            "all_match_clean": all(bool(r.matches_clean) for r in runs),
        }
        for _, key, _fmt in SUMMARY:
            vals = [float(v) for r in runs if (v := r.row()[key]) is not None]
            doc[key] = (
                {"median": statistics.median(vals), "low": min(vals), "high": max(vals)}
                if vals
                else None
            )
        out.append(doc)
    return out


def format_summary(results: list[ConfigResult]) -> str:
    """The medians and ranges of ``summarize`` as a table ('' when nothing ran twice)."""
    docs = summarize(results)
    if not docs:
        return ""
    w = max([12, *(len(d["config"]) for d in docs)])
    head = (
        f"{'config':<{w}} {'runs':>4} "
        + " ".join(f"{h + ' median (range)':>30}" for h, _, _ in SUMMARY)
        + f" {'= clean':>8}"
    )
    lines = [head, "-" * len(head)]
    for d in docs:
        cells = []
        for _, key, fmt in SUMMARY:
            v = d[key]
            text = "–" if v is None else f"{fmt(v['median'])} ({fmt(v['low'])}-{fmt(v['high'])})"
            cells.append(f"{text:>30}")
        ok = "all" if d["all_match_clean"] else "NO"
        lines.append(f"{d['config']:<{w}} {d['runs']:>4} " + " ".join(cells) + f" {ok:>8}")
    return "\n".join(lines)
