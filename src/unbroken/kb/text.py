"""Plain-text views of knowledge-base records: ``kb show`` and ``kb compare``."""

from __future__ import annotations

from typing import Any

from unbroken.kb.extract import RunRecord

FIGURES = (
    ("status", "status"),
    ("steps_completed", "steps completed"),
    ("wall_s", "wall time s"),
    ("training_goodput", "training goodput"),
    ("infra_goodput", "infra goodput"),
    ("availability", "availability"),
    ("checkpoint_efficiency", "checkpoint efficiency"),
    ("recovery_s_median", "recovery s (median)"),
    ("recovery_s_max", "recovery s (max)"),
    ("step_time_s_median", "step time s (median)"),
    ("num_attempts", "launcher attempts"),
    ("final_state_sha256", "final state sha256"),
    ("error_reason", "gave up because"),
)
_RATIOS = {"training_goodput", "infra_goodput", "availability", "checkpoint_efficiency"}


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in _RATIOS:
        return f"{float(value) * 100:.1f}%"
    if isinstance(value, float):
        return f"{value:.3f}"
    if key == "final_state_sha256":
        return str(value)[:16]
    return str(value)


def _rows(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _fault_summary(rec: RunRecord) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in rec.faults:
        out[str(f["kind"])] = out.get(str(f["kind"]), 0) + 1
    return out


def show(rec: RunRecord) -> str:
    """One run: results, configuration, fault trace."""
    lines = [f"run {rec.name} ({rec.run})", f"path {rec.path}", "", "results"]
    lines += _rows([[label, _fmt(k, rec.results.get(k))] for k, label in FIGURES])
    lines += ["", "configuration"]
    lines += _rows([[k, str(v)] for k, v in sorted(rec.config.items())]) if rec.config else ["-"]
    lines += ["", "faults"]
    if rec.faults:
        head = [
            "#",
            "kind",
            "rank",
            "step",
            "cause",
            "detector",
            "layer",
            "detect s",
            "recover s",
            "lost",
            "tier",
            "message",
        ]
        body = [
            [
                str(f["index"]),
                str(f["kind"]),
                str(f["rank"]),
                _fmt("step", f["step"]),
                _fmt("cause", f["cause"]),
                _fmt("detector", f["detector"]),
                _fmt("layer", f["layer"]),
                _fmt("s", f["detection_s"]),
                _fmt("s", f["recovery_s"]),
                _fmt("lost", f["steps_lost"]),
                _fmt("tier", f["restore_tier"]),
                str(f.get("message") or "")[:60],
            ]
            for f in rec.faults
        ]
        lines += _rows([head, *body])
    else:
        lines.append("no faults")
    return "\n".join(lines) + "\n"


def compare(a: RunRecord, b: RunRecord) -> str:
    """Two runs side by side: results, faults by kind, and the configuration that differs."""
    lines = _rows(
        [["", a.name, b.name]]
        + [[label, _fmt(k, a.results.get(k)), _fmt(k, b.results.get(k))] for k, label in FIGURES]
    )
    fa, fb = _fault_summary(a), _fault_summary(b)
    lines += ["", "faults by kind"]
    kinds = sorted(set(fa) | set(fb))
    lines += (
        _rows([[k, str(fa.get(k, 0)), str(fb.get(k, 0))] for k in kinds]) if kinds else ["none"]
    )
    keys = sorted(set(a.config) | set(b.config))
    diff = [k for k in keys if a.config.get(k) != b.config.get(k) and not k.endswith(".host")]
    lines += ["", "configuration that differs"]
    if diff:
        lines += _rows([[k, str(a.config.get(k, "-")), str(b.config.get(k, "-"))] for k in diff])
    else:
        lines.append("none")
    return "\n".join(lines) + "\n"
