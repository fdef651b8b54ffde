"""A self-contained HTML report of one or more runs: inline SVG charts, no script, no network.

Charts: step vs wall time per run with faults marked; a goodput/badput bar per run; a per-fault
table; the recovery figures per fault class and per phase; a line per run whose checkpoint saves
failed (how long it went unprotected). Every chart is plain SVG computed here, so the file
renders the same in any browser, offline, and a test can check that each chart has drawn marks.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from unbroken.ledger.events import STEP, Event
from unbroken.ledger.fault_summary import FaultFigures
from unbroken.ledger.goodput import RunReport
from unbroken.ledger.report import storage_line

# One colour per category; productive first. Colour-blind-safe-ish (Okabe-Ito + greys).
COLORS = {
    "productive": "#009E73",
    "reexecuted": "#D55E00",
    "checkpoint_save": "#E69F00",
    "checkpoint_load": "#F0E442",
    "startup": "#56B4E9",
    "rendezvous": "#0072B2",
    "pg_init": "#7FB8DA",
    "model_build": "#A6CEE3",
    "data": "#CCE5F0",
    "detection": "#CC79A7",
    "recovery": "#B22222",
    "shutdown": "#999999",
    "preemption": "#E69F00",
    "other": "#DDDDDD",
}
LINE_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]


@dataclass(frozen=True)
class RunView:
    """One run to show: a label, its figures and its events."""

    label: str
    report: RunReport
    events: Sequence[Event]


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _step_points(view: RunView, reference_rank: int) -> list[tuple[float, int]]:
    t0 = min(e.begin for e in view.events)
    return [
        (e.ts - t0, int(e.get("step")))
        for e in sorted(view.events, key=lambda e: e.ts)
        if e.kind == STEP and e.rank == reference_rank and e.get("step") is not None
    ]


def _segments(pts: list[tuple[float, int]]) -> list[list[tuple[float, int]]]:
    """Split a run's points where training stopped: a rollback, a skip, or a long gap."""
    if not pts:
        return []
    gaps = sorted(b[0] - a[0] for a, b in zip(pts, pts[1:], strict=False))
    typical = gaps[len(gaps) // 2] if gaps else 0.0
    segs = [[pts[0]]]
    for prev, cur in zip(pts, pts[1:], strict=False):
        if cur[1] != prev[1] + 1 or (typical > 0 and cur[0] - prev[0] > 3 * typical):
            segs.append([])
        segs[-1].append(cur)
    return segs


def step_chart(views: Sequence[RunView], *, reference_rank: int = 0) -> str:
    """SVG: completed step vs seconds since the run began, one line per run, faults marked."""
    w, h, ml, mr, mt, mb = 760, 320, 56, 16, 16, 44
    series = [(v, _step_points(v, reference_rank)) for v in views]
    max_t = max([v.report.wall_s for v in views] + [1e-9])
    max_s = max([s for _, pts in series for _, s in pts] + [1])

    def x(t: float) -> float:
        return ml + (w - ml - mr) * t / max_t

    def y(s: float) -> float:
        return h - mb - (h - mt - mb) * s / max_s

    out = [
        f'<svg class="chart step-chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
        f'role="img" aria-label="training step versus wall time">',
        f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="#333"/>',
        f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="#333"/>',
    ]
    for i in range(6):
        t = max_t * i / 5
        out.append(
            f'<text x="{x(t):.1f}" y="{h - mb + 16}" font-size="11" text-anchor="middle">'
            f"{t:.1f}</text>"
        )
        s = max_s * i / 5
        out.append(
            f'<text x="{ml - 6}" y="{y(s) + 4:.1f}" font-size="11" text-anchor="end">{s:.0f}</text>'
        )
    out.append(
        f'<text x="{(ml + w - mr) / 2}" y="{h - 6}" font-size="12" text-anchor="middle">'
        "seconds since the job started</text>"
    )
    out.append(
        f'<text x="14" y="{(mt + h - mb) / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {(mt + h - mb) / 2})">step</text>'
    )
    for i, (view, pts) in enumerate(series):
        color = LINE_COLORS[i % len(LINE_COLORS)]
        t0 = min(e.begin for e in view.events)
        for f in view.report.faults:
            fx = x(f.fault_ts - t0)
            out.append(
                f'<line class="fault-mark" x1="{fx:.1f}" y1="{mt}" x2="{fx:.1f}" y2="{h - mb}" '
                f'stroke="{color}" stroke-dasharray="4 3" opacity="0.8">'
                f"<title>{_esc(view.label)}: fault #{f.index} {_esc(f.kind)} on rank {f.rank}"
                f"</title></line>"
            )
        for seg in _segments(pts):
            path = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in seg)
            out.append(
                f'<polyline class="series" points="{path}" fill="none" stroke="{color}" '
                f'stroke-width="1.8"><title>{_esc(view.label)}</title></polyline>'
            )
        ly = mt + 14 + 16 * i
        out.append(
            f'<rect x="{ml + 10}" y="{ly - 9}" width="12" height="3" fill="{color}"/>'
            f'<text x="{ml + 28}" y="{ly - 4}" font-size="12">{_esc(view.label)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def breakdown_chart(views: Sequence[RunView]) -> str:
    """SVG: one stacked bar per run, wall time split into productive and badput categories."""
    bar_h, gap, ml, w = 22, 14, 150, 760
    h = len(views) * (bar_h + gap) + 60
    out = [
        f'<svg class="chart breakdown-chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
        'role="img" aria-label="goodput and badput breakdown">'
    ]
    used: list[str] = []
    for i, view in enumerate(views):
        rep = view.report
        y0 = 10 + i * (bar_h + gap)
        out.append(
            f'<text x="{ml - 8}" y="{y0 + bar_h - 6}" font-size="12" text-anchor="end">'
            f"{_esc(view.label)}</text>"
        )
        order = {c: i for i, c in enumerate(COLORS)}
        badput = sorted(rep.badput_s.items(), key=lambda kv: order.get(kv[0], len(order)))
        parts = [("productive", rep.productive_s), *badput]
        xpos = float(ml)
        for cat, secs in parts:
            if secs <= 0 or rep.wall_s <= 0:
                continue
            width = (w - ml - 10) * secs / rep.wall_s
            if cat not in used:
                used.append(cat)
            out.append(
                f'<rect class="segment" x="{xpos:.2f}" y="{y0}" width="{width:.2f}" '
                f'height="{bar_h}" fill="{COLORS.get(cat, "#888")}">'
                f"<title>{_esc(cat)}: {secs:.3f} s ({100 * secs / rep.wall_s:.1f}%)</title></rect>"
            )
            xpos += width
    ly = len(views) * (bar_h + gap) + 18
    lx = 10.0
    for cat in used:
        out.append(
            f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{COLORS.get(cat, "#888")}"/>'
            f'<text x="{lx + 14}" y="{ly + 9}" font-size="11">{_esc(cat)}</text>'
        )
        lx += 14 + 7 * len(cat) + 14
        if lx > w - 100:
            lx, ly = 10.0, ly + 16
    out.append("</svg>")
    return "".join(out)


def _summary_table(views: Sequence[RunView]) -> str:
    head = (
        "<tr><th>run</th><th>training goodput</th><th>infra goodput</th><th>availability</th>"
        "<th>ETTR</th>"
        "<th>checkpoint efficiency</th><th>wall s</th><th>steps</th><th>faults</th>"
        "<th>recovery s p50 / max</th></tr>"
    )
    rows = []
    for v in views:
        r = v.report
        rows.append(
            f"<tr><td>{_esc(v.label)}</td><td>{_pct(r.training_goodput)}</td>"
            f"<td>{_pct(r.infra_goodput)}</td><td>{_pct(r.availability)}</td>"
            f"<td>{_pct(r.ettr)}</td>"
            f"<td>{_pct(r.checkpoint_efficiency)}</td><td>{r.wall_s:.2f}</td>"
            f"<td>{r.steps_completed}</td><td>{len(r.faults)}</td>"
            f"<td>{_fmt(r.recovery_s_median)} / {_fmt(r.recovery_s_max)}</td></tr>"
        )
    return f'<table class="summary">{head}{"".join(rows)}</table>'


def _storage_lines(views: Sequence[RunView]) -> str:
    """One warning line per run whose checkpoint saves failed ("" when none did)."""
    lines = [(v.label, storage_line(v.report.storage)) for v in views]
    return "".join(
        f"<p class='warn storage-failing'>{_esc(label)}: {_esc(line)}</p>"
        for label, line in lines
        if line is not None
    )


def _fault_table(views: Sequence[RunView]) -> str:
    head = (
        "<tr><th>run</th><th>#</th><th>kind</th><th>class</th><th>phase</th><th>rank</th>"
        "<th>step</th><th>cause</th>"
        "<th>detector</th><th>layer</th><th>detection s</th><th>recovery s</th>"
        "<th>steps lost</th><th>restore tier</th></tr>"
    )
    rows = [
        f"<tr><td>{_esc(v.label)}</td><td>{f.index}</td><td>{_esc(f.kind)}</td>"
        f"<td>{_esc(f.fault_class)}</td><td>{_esc(f.phase or '–')}</td><td>{f.rank}</td>"
        f"<td>{'–' if f.step is None else f.step}</td>"
        f"<td>{_esc(f.cause or '–')}</td><td>{_esc(f.detector or '–')}</td>"
        f"<td>{_esc(f.layer or '–')}</td><td>{_fmt(f.detection_s)}</td>"
        f"<td>{_fmt(f.recovery_s)}</td>"
        f"<td>{'–' if f.steps_lost is None else f.steps_lost}</td>"
        f"<td>{_esc(f.restore_tier or '–')}</td></tr>"
        for v in views
        for f in v.report.faults
    ]
    if not rows:
        return "<p>No faults.</p>"
    return f'<table class="faults">{head}{"".join(rows)}</table>'


def _group_row(label: str, name: str, g: FaultFigures) -> str:
    lost_mean = "–" if g.steps_lost_mean is None else f"{g.steps_lost_mean:.1f}"
    return (
        f"<tr><td>{_esc(label)}</td><td>{_esc(name)}</td><td>{g.faults}</td>"
        f"<td>{g.recovered} ({_pct(g.recovery_rate)})</td><td>{_fmt(g.recovery_s_p50)}</td>"
        f"<td>{_fmt(g.recovery_s_p95)}</td><td>{_fmt(g.recovery_s_max)}</td>"
        f"<td>{g.failed_restarts}</td><td>{g.steps_lost}</td>"
        f"<td>{'–' if g.steps_lost_max is None else g.steps_lost_max}</td><td>{lost_mean}</td>"
        f"<td>{_fmt(g.detection_s_p50)}</td></tr>"
    )


def fault_group_table(views: Sequence[RunView], *, key: str) -> str:
    """A table of each run's recovery figures per fault ``key``: "class" or "phase"."""
    head = (
        f"<tr><th>run</th><th>{_esc(key)}</th><th>faults</th><th>recovered</th>"
        "<th>recovery p50 s</th><th>p95 s</th><th>max s</th><th>failed restarts</th>"
        "<th>steps lost</th><th>most lost</th><th>lost/incident</th><th>detection p50 s</th></tr>"
    )
    rows = [
        _group_row(v.label, name, g)
        for v in views
        for name, g in (v.report.by_class if key == "class" else v.report.by_phase).items()
    ]
    if not rows:
        return ""
    return f'<table class="fault-groups by-{_esc(key)}">{head}{"".join(rows)}</table>'


def _degradation_table(views: Sequence[RunView]) -> str:
    """Degradation windows with their cost, and straggler episodes ("" when none)."""
    out = []
    rows = [
        f"<tr><td>{_esc(v.label)}</td><td>{f.index}</td><td>{_esc(f.kind)}</td>"
        f"<td>{f.rank}</td><td>{_fmt(f.window_s, 1)}</td><td>{_fmt(f.step_s_inside)}</td>"
        f"<td>{_fmt(v.report.step_time_s_outside)}</td><td>{_fmt(f.degraded_s)}</td></tr>"
        for v in views
        for f in v.report.faults
        if f.window_s is not None
    ]
    if rows:
        head = (
            "<tr><th>run</th><th>#</th><th>kind</th><th>rank</th><th>window s</th>"
            "<th>median step inside s</th><th>outside s</th><th>cost s</th></tr>"
        )
        out.append(f"<h2>Degradation</h2><table>{head}{''.join(rows)}</table>")
    rows = [
        f"<tr><td>{_esc(v.label)}</td><td>{x.rank}</td><td>{_fmt(x.end_ts - x.begin_ts, 1)}</td>"
        f"<td>{x.steps}</td><td>{_pct(x.busy_ratio)}</td><td>{_pct(x.others_ratio)}</td></tr>"
        for v in views
        for x in v.report.stragglers
    ]
    if rows:
        head = (
            "<tr><th>run</th><th>rank</th><th>for s</th><th>steps</th><th>busy</th>"
            "<th>others' busy</th></tr>"
        )
        out.append(
            f"<h2>Stragglers</h2><table>{head}{''.join(rows)}</table><p class='note'>busy = "
            "time on or waiting for a CPU ÷ step time: the straggler computes while the others "
            "wait for it.</p>"
        )
    return "".join(out)


_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1000px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.note{color:#555;font-size:13px}
.warn{background:#fff4e5;border-left:4px solid #E69F00;padding:4px 8px;font-size:13px}
.fault-groups td:nth-child(2),.fault-groups th:nth-child(2){text-align:left}
"""


def render(views: Sequence[RunView], *, title: str = "unbroken goodput report") -> str:
    """The whole HTML document."""
    if not views:
        raise ValueError("render needs at least one run")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_esc(title)}</h1>"
        f"<h2>Figures</h2>{_summary_table(views)}{_storage_lines(views)}"
        "<p class='note'>training goodput = time of steps that survived ÷ wall time; "
        "infrastructure goodput = 1 − (shutdown + startup per fault: detected-to-resumed time) "
        "÷ wall time, the published definition; availability = 1 − fault-to-resumed time ÷ "
        "wall time (detection included).</p>"
        f"<h2>Progress: step vs wall time</h2>{step_chart(views)}"
        "<p class='note'>Dashed lines mark faults; a drop in a line is a rollback.</p>"
        f"<h2>Where the time went</h2>{breakdown_chart(views)}"
        f"<h2>Faults</h2>{_fault_table(views)}"
        + (
            f"<h2>Recovery per fault class</h2>{fault_group_table(views, key='class')}"
            f"<h2>Recovery per phase</h2>{fault_group_table(views, key='phase')}"
            "<p class='note'>recovered: training resumed after the fault; failed restarts: "
            "restart rounds that did not bring training back; p95 is linear between the two "
            "nearest ranks.</p>"
            if any(v.report.faults for v in views)
            else ""
        )
        + f"{_degradation_table(views)}"
        + "</body></html>"
    )
