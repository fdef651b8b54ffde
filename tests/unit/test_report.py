"""The plain-text and JSON renderings of a RunReport."""

from __future__ import annotations

import json

from unbroken.ledger.events import (
    CKPT_LOAD,
    FAULT_DETECTED,
    FAULT_INJECTED,
    JOB_END,
    PHASE,
    RESTART_BEGIN,
    RESTART_END,
    STEP,
    Event,
)
from unbroken.ledger.goodput import compute
from unbroken.ledger.html import RunView, render
from unbroken.ledger.report import format_table, to_json


def ev(kind: str, ts: float, *, rank: int = 0, attempt: int = 0, **data) -> Event:
    return Event(kind=kind, ts=ts, run="demo", rank=rank, attempt=attempt, data=data)


def steps(first: int, last: int, start: float, **kw) -> list[Event]:
    return [
        ev(STEP, start + k + 1, dur_s=1.0, step=n, **kw)
        for k, n in enumerate(range(first, last + 1))
    ]


def plain_events() -> list[Event]:
    """import [0, 1], pg_init [1, 1.5], model_build [1.5, 2], steps [2, 12], job end 12.5."""
    return [
        ev(PHASE, 1.0, dur_s=1.0, name="import"),
        ev(PHASE, 1.5, dur_s=0.5, name="pg_init"),
        ev(PHASE, 2.0, dur_s=0.5, name="model_build"),
        *steps(0, 9, 2.0),
        ev(JOB_END, 12.5, rank=-1, status="ok"),
    ]


def fault_events() -> list[Event]:
    """Steps 0..7 over [0, 8]; fault at 8 on rank 1; detected 8.25; load; steps 5..9 from 9.5."""
    return [
        *steps(0, 7, 0.0),
        ev(FAULT_INJECTED, 8.0, rank=1, fault="sigkill", step=7),
        ev(FAULT_DETECTED, 8.25, rank=-1, cause="signal", detector="exit_code", layer="launcher"),
        ev(RESTART_END, 8.5, rank=-1, attempt=1, layer="launcher"),
        ev(CKPT_LOAD, 9.5, dur_s=1.0, attempt=1, step=5, tier="disk"),
        *steps(5, 9, 9.5, attempt=1),  # [9.5, 14.5]
    ]


def test_table_plain_run():
    text = format_table(compute(plain_events()))
    assert "demo" in text
    assert "80.0%" in text  # training goodput 10 / 12.5
    assert "87.0%" in text  # ETTR 10 / 11.5 = 0.8696
    assert "100.0%" in text  # infra goodput
    assert "12.500 s" in text
    assert "no faults" in text
    # Badput rows: startup (1 s) first, zero categories left out.
    assert text.index("startup") < text.index("pg_init")
    assert "8.0%" in text  # startup 1 / 12.5
    assert "4.0%" in text  # pg_init, model_build and other 0.5 / 12.5
    assert "reexecuted" not in text and "detection" not in text


def test_table_fault_rows():
    r = compute(fault_events())
    text = format_table(r)
    assert "no faults" not in text
    [row] = [line for line in text.splitlines() if "sigkill" in line]
    cells = row.split()
    # #, kind, class, phase, rank, step, detector, layer, detection s, recovery s, steps lost,
    # restore tier
    assert cells == [
        "0",
        "sigkill",
        "crash",
        "step",
        "1",
        "7",
        "exit_code",
        "launcher",
        "0.250",
        "2.500",
        "3",
        "disk",
    ]
    # training goodput 10 / 14.5, infra 1 - 1.5 / 14.5
    assert f"{10 / 14.5 * 100:.1f}%" in text
    assert f"{(1 - 1.5 / 14.5) * 100:.1f}%" in text
    badput = text.split("badput")[1].split("faults")[0]
    assert badput.index("reexecuted") < badput.index("checkpoint_load")  # 3 s before 1 s


def test_to_json_round_trip():
    r = compute(fault_events())
    d = json.loads(to_json(r))
    for key in (
        "training_goodput",
        "infra_goodput",
        "availability",
        "checkpoint_efficiency",
        "ettr",
        "wall_s",
        "productive_s",
        "steps_completed",
        "faults",
        "badput_s",
    ):
        assert key in d
    assert d["wall_s"] == 14.5
    assert d["steps_completed"] == 10
    assert d["faults"][0]["kind"] == "sigkill" and d["faults"][0]["steps_lost"] == 3
    assert d["badput_s"]["reexecuted"] == 3.0
    assert d == r.to_dict()
    assert to_json(r).startswith('{\n  "')  # indent 2
    assert list(d) == sorted(d)


def test_table_figures_per_class_and_phase():
    events = [
        *fault_events(),
        ev(RESTART_BEGIN, 8.3, rank=-1, layer="launcher", round=1),
        ev(RESTART_BEGIN, 8.3, rank=-1, layer="launcher", round=1),  # a second node's agent
    ]
    text = format_table(compute(events))
    by_class, by_phase = text.split("faults by class")[1].split("faults by phase")
    [row] = [line for line in by_class.splitlines() if line.startswith("crash")]
    # class, faults, recovered (rate), recovery s p50 / p95 / max, failed restarts, steps lost
    # (total, max, per incident), detection s p50
    assert row.split() == [
        "crash",
        "1",
        "1",
        "(100%)",
        "2.500",
        "2.500",
        "2.500",
        "0",
        "3",
        "3",
        "3.0",
        "0.250",
    ]
    [row] = [line for line in by_phase.splitlines() if line.startswith("step")]
    assert row.split()[:2] == ["step", "1"]
    assert "faults by class" not in format_table(compute(plain_events()))


def test_json_has_the_figures_per_class_and_phase():
    d = json.loads(to_json(compute(fault_events())))
    assert d["faults"][0]["fault_class"] == "crash" and d["faults"][0]["phase"] == "step"
    assert d["by_class"]["crash"]["steps_lost"] == 3
    assert d["by_class"]["crash"]["recovery_s_p95"] == 2.5
    assert d["by_phase"]["step"]["faults"] == 1


def test_html_has_the_figures_per_class_and_phase():
    events = fault_events()
    text = render([RunView("faulty", compute(events), events)])
    assert '<table class="fault-groups by-class">' in text
    assert '<table class="fault-groups by-phase">' in text
    row = text.split('by-class">')[1].split("</tr>")[1]
    assert row.startswith("<tr><td>faulty</td><td>crash</td><td>1</td><td>1 (100.0%)</td>")
    clean = plain_events()
    assert '<table class="fault-groups' not in render([RunView("clean", compute(clean), clean)])
