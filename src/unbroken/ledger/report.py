"""Render a ``RunReport`` as a plain-text table or as JSON (standard library only)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from unbroken.ledger.fault_summary import FaultFigures
from unbroken.ledger.goodput import ML_GOODPUT, RunReport
from unbroken.ledger.unprotected import StorageFailures

_FAULT_HEADERS = (
    "#",
    "kind",
    "class",
    "phase",
    "rank",
    "step",
    "detector",
    "layer",
    "detection s",
    "recovery s",
    "steps lost",
    "restore tier",
)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _clock(ts: float) -> str:
    """Local time of day of epoch seconds, to the millisecond (as the logs show it)."""
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: set[int]) -> list[str]:
    """Aligned columns; indices in ``right`` are right-aligned (numbers)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return out


GROUP_HEADERS = (
    "faults",
    "recovered",
    "recovery p50 s",
    "p95 s",
    "max s",
    "failed restarts",
    "steps lost",
    "most lost",
    "lost/incident",
    "detection p50 s",
)
"""The columns of ``fault_group_table`` after its key columns (``FaultFigures``' figures)."""


def _group_cells(g: FaultFigures) -> list[str]:
    return [
        str(g.faults),
        f"{g.recovered} ({g.recovery_rate * 100:.0f}%)",
        _secs(g.recovery_s_p50),
        _secs(g.recovery_s_p95),
        _secs(g.recovery_s_max),
        str(g.failed_restarts),
        str(g.steps_lost),
        _text(g.steps_lost_max),
        "-" if g.steps_lost_mean is None else f"{g.steps_lost_mean:.1f}",
        _secs(g.detection_s_p50),
    ]


def fault_group_table(
    key_headers: Sequence[str], rows: Sequence[tuple[Sequence[str], FaultFigures]]
) -> list[str]:
    """Lines of an aligned table of fault figures, one row per (key cells, figures): per class,
    per phase, per configuration and class, ..."""
    cells = [[*keys, *_group_cells(g)] for keys, g in rows]
    n = len(key_headers)
    return _table(
        (*key_headers, *GROUP_HEADERS), cells, right=set(range(n, n + len(GROUP_HEADERS)))
    )


def format_table(report: RunReport) -> str:
    """A readable report: header figures, the badput breakdown, and one row per fault."""
    header = [
        ("run", report.run or "-"),
        ("wall time", f"{report.wall_s:.3f} s"),
        ("productive", f"{report.productive_s:.3f} s"),
        ("training goodput", _pct(report.training_goodput)),
        ("infra goodput", _pct(report.infra_goodput)),
        ("availability", _pct(report.availability)),
        ("checkpoint efficiency", _pct(report.checkpoint_efficiency)),
        ("ETTR", _pct(report.ettr)),
        ("steps completed", str(report.steps_completed)),
        ("attempts", str(report.num_attempts)),
        ("in-process iterations", str(report.num_iterations)),
        ("median step time", f"{_secs(report.step_time_s_median)} s"),
        ("faults", str(len(report.faults))),
        (
            "fault cost",
            f"{report.fault_s:.3f} s"
            + (
                f" ({report.fault_s / report.wall_s * 100:.1f}% of wall)"
                if report.wall_s > 0
                else ""
            ),
        ),
    ]
    width = max(len(name) for name, _ in header)
    lines = [f"{name.ljust(width)}  {value}" for name, value in header]
    storage = storage_line(report.storage)
    if storage is not None:
        lines += ["", storage]

    lines += ["", "badput"]
    wall = report.wall_s
    badput = sorted(
        ((name, s) for name, s in report.badput_s.items() if s > 0),
        key=lambda item: (-item[1], item[0]),
    )
    if badput:
        ml = ML_GOODPUT
        rows = [
            [name, ml[name], f"{s:.3f}", f"{s / wall * 100:.1f}%" if wall > 0 else "n/a"]
            for name, s in badput
        ]
        lines += _table(
            ("category", "ml-goodput category", "seconds", "% of wall"), rows, right={2, 3}
        )
        if report.custom_s:
            shown = ", ".join(f"{name} {s:.3f} s" for name, s in report.custom_s.items())
            lines.append(f"custom: the script's own phases: {shown}")
    else:
        lines.append("no badput")

    lines += ["", "faults"]
    if report.faults:
        rows = [
            [
                str(f.index),
                _text(f.kind),
                f.fault_class,
                _text(f.phase),
                str(f.rank),
                _text(f.step),
                _text(f.detector),
                _text(f.layer),
                _secs(f.detection_s),
                _secs(f.recovery_s),
                _text(f.steps_lost),
                _text(f.restore_tier),
            ]
            for f in report.faults
        ]
        lines += _table(_FAULT_HEADERS, rows, right={0, 4, 5, 8, 9, 10})
        for title, key, groups in (
            ("faults by class", "class", report.by_class),
            ("faults by phase", "phase", report.by_phase),
        ):
            lines += ["", title]
            lines += fault_group_table((key,), [((name,), g) for name, g in groups.items()])
    else:
        lines.append("no faults")
    lines += _degradation(report)
    return "\n".join(lines) + "\n"


ERROR_CHARS = 200
"""The most of an error message a one-line summary shows (its first line)."""


def storage_line(storage: StorageFailures) -> str | None:
    """One line on the failed checkpoint saves and the time the run went unprotected.

    Args:
        storage: The report's ``storage``.

    Returns:
        The line, or None when no save failed.
    """
    if not storage.failed_saves:
        return None
    n = storage.failed_saves
    parts = [f"{n} save{'s' if n != 1 else ''} failed"]
    if storage.saves_held_back:
        parts.append(f"{storage.saves_held_back} held back")
    unprotected = f"unprotected for {storage.unprotected_s:.1f} s"
    if storage.failing:
        unprotected += ", still at the end"
    parts.append(unprotected)
    line = "checkpoint storage failing: " + ", ".join(parts)
    error = (storage.last_error or "").strip().splitlines()
    if error:
        first = error[0] if len(error[0]) <= ERROR_CHARS else error[0][: ERROR_CHARS - 1] + "…"
        line += f" (last error: {first})"
    return line


def _degradation(report: RunReport) -> list[str]:
    """The degradation windows and their cost, and the stragglers (none: no lines)."""
    lines: list[str] = []
    priced = [f for f in report.faults if f.window_s is not None]
    if priced:
        lines += [
            "",
            f"degradation (undegraded median step {_secs(report.step_time_s_outside)} s; "
            f"cost {report.degraded_s:.3f} s)",
        ]
        rows = [
            [
                str(f.index),
                _text(f.kind),
                str(f.rank),
                f"{f.window_s:.1f}",
                _secs(f.step_s_inside),
                _secs(f.degraded_s),
            ]
            for f in priced
            if f.window_s is not None
        ]
        heads = ("#", "kind", "rank", "window s", "median step s", "cost s")
        lines += _table(heads, rows, right={0, 2, 3, 4, 5})
    if report.stragglers:
        lines += ["", "stragglers (busy: time on or waiting for a CPU / step time)"]
        rows = [
            [
                str(s.rank),
                _clock(s.begin_ts),
                f"{s.end_ts - s.begin_ts:.1f}",
                str(s.steps),
                f"{s.busy_ratio:.2f}",
                f"{s.others_ratio:.2f}",
            ]
            for s in report.stragglers
        ]
        heads = ("rank", "from", "for s", "steps", "busy", "others' busy")
        lines += _table(heads, rows, right={0, 2, 3, 4, 5})
    return lines


def to_json(report: RunReport) -> str:
    """The report's ``to_dict()`` as JSON, indented by 2, keys sorted."""
    return json.dumps(report.to_dict(), indent=2, sort_keys=True)


def to_json_many(reports: list[RunReport]) -> str:
    """Several reports as one JSON list, in the given order."""
    return json.dumps([r.to_dict() for r in reports], indent=2, sort_keys=True)
