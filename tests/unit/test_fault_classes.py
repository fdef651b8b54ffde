"""Fault classes and phases, restart rounds, and the recovery figures per class and per phase,
on hand-built timelines; every expected number is derived from the timeline."""

from __future__ import annotations

import json

import pytest

from unbroken.faults.plan import KINDS
from unbroken.launcher.errors import _SIGNAL_CAUSES
from unbroken.ledger.events import (
    FAULT_DETECTED,
    FAULT_INJECTED,
    JOB_END,
    RESTART_BEGIN,
    RESTART_END,
    STEP,
    Event,
)
from unbroken.ledger.fault_classes import CLASSES, INJECTED_CLASSES, fault_class, natural_class
from unbroken.ledger.fault_records import FaultRecord
from unbroken.ledger.fault_summary import by_class, by_phase, quantile
from unbroken.ledger.goodput import compute
from unbroken.restart import assign


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-9)


def ev(kind: str, ts: float, *, rank: int = 0, attempt: int = 0, iteration: int = 0, **data):
    return Event(
        kind=kind, ts=ts, run="r", rank=rank, attempt=attempt, iteration=iteration, data=data
    )


def steps(first: int, last: int, start: float, *, ranks=(0, 1), **kw) -> list[Event]:
    """Steps ``first..last``, 1 s each, back to back from ``start``, on every rank of ranks."""
    return [
        ev(STEP, start + k + 1, rank=r, dur_s=1.0, step=n, **kw)
        for k, n in enumerate(range(first, last + 1))
        for r in ranks
    ]


# --- the class of a fault ----------------------------------------------------------------------
def test_every_injectable_kind_has_a_class() -> None:
    missing = sorted(set(KINDS) - set(INJECTED_CLASSES))
    assert not missing, f"fault kinds without a class in ledger.fault_classes: {missing}"
    for kind in KINDS:
        assert fault_class(kind, injected=True) in CLASSES
        assert fault_class(kind, injected=True) != "other", kind


def test_injected_kinds_map_to_the_classes_the_study_names() -> None:
    expected = {
        "exception": "exception",
        "hang": "hang",
        "hang-collective": "hang",
        "hang-native": "hang",
        "sigkill": "crash",
        "segfault": "crash",
        "oom-kill": "crash",
        "sigterm": "crash",
        "node-loss": "node",
        "node-drain": "node",  # the emulated cluster evicts a pod
        "slow-storage": "storage",
        "checkpoint-corruption": "storage",
    }
    for kind, cls in expected.items():
        assert fault_class(kind, injected=True) == cls, kind
    assert fault_class("a-kind-from-the-future", injected=True) == "other"


@pytest.mark.parametrize(
    ("cause", "cls"),
    [
        (assign.HANG, "hang"),
        (assign.STUCK, "hang"),
        (assign.EXCEPTION, "exception"),
        ("RuntimeError", "exception"),
        ("InjectedFault", "exception"),
        ("SIGKILL", "crash"),  # the emulated orchestrator names signals so
        ("exit 1", "crash"),
        ("exit_code", "crash"),
        ("signal:SIGUSR1", "crash"),
        ("oom-kill", "crash"),
        ("node_lost", "node"),
        ("node-loss", "node"),
        ("agent_sigterm", "node"),
        ("rendezvous", "other"),
        (assign.PG_INIT, "other"),
        (assign.PEER, "other"),
        ("nan", "other"),
        (None, "other"),
        ("", "other"),
    ],
)
def test_natural_cause_class(cause: str | None, cls: str) -> None:
    assert natural_class(cause) == cls
    assert fault_class(cause, injected=False) == cls


def test_every_signal_the_launcher_names_is_a_crash() -> None:
    for cause, _category in _SIGNAL_CAUSES.values():
        assert natural_class(cause) == "crash", cause


# --- quantiles ---------------------------------------------------------------------------------
def test_quantile_on_a_known_list() -> None:
    xs = [float(x) for x in range(20, 0, -1)]  # 1..20, unsorted
    assert quantile(xs, 0.95) == approx(19.05)  # 19 + 0.05 * (20 - 19): position 18.05
    assert quantile(xs, 0.5) == approx(10.5)
    assert quantile(xs, 1.0) == 20.0 and quantile(xs, 0.0) == 1.0
    assert quantile([3.0, 1.0, 2.0, 10.0], 0.95) == approx(8.95)  # 3 + 0.85 * 7
    assert quantile([4.2], 0.95) == 4.2
    assert quantile([], 0.5) is None
    with pytest.raises(ValueError, match="between 0 and 1"):
        quantile(xs, 95)


# --- phases, classes and restart rounds from a timeline ----------------------------------------
def phased_run() -> list[Event]:
    """Four faults, one recovered at a time; steps are 1 s on ranks 0 and 1.

    1. injected sigkill on entering ``save`` at 5 (steps 0..4 done); the launcher restarts it
       (round 1: two agents write the round); resumes at 7 from step 3: 2 steps lost.
    2. injected exception after a step (no phase) at 10; an in-process restart on both ranks
       (one round), then a second in-process round on both ranks (the first failed); resumes
       at 12 from step 5: 1 step lost.
    3. natural ``stuck`` detected at 15, phase unknown; one in-process round; resumes at 16:
       0 lost.
    4. natural ``RuntimeError`` detected at 20 naming phase ``data``; one round, never resumes.
    """
    out = [*steps(0, 4, 0.0)]  # [0, 5]
    out += [
        ev(FAULT_INJECTED, 5.0, rank=1, fault="sigkill", step=5, index=0, phase="save"),
        ev(FAULT_DETECTED, 5.25, rank=-1, cause="sigkill", detector="exit", layer="launcher"),
        ev(RESTART_BEGIN, 5.3, rank=-1, layer="launcher", round=1),
        ev(RESTART_BEGIN, 5.3, rank=-1, layer="launcher", round=1),  # the other node's agent
        ev(RESTART_END, 6.5, rank=-1, attempt=1, layer="launcher"),
    ]
    out += steps(3, 5, 7.0, attempt=1)  # [7, 10]
    out += [
        ev(FAULT_INJECTED, 10.0, rank=0, attempt=1, fault="exception", step=5, index=1),
        ev(FAULT_DETECTED, 10.1, rank=0, attempt=1, cause="InjectedFault", detector="exception"),
        ev(RESTART_BEGIN, 10.2, rank=0, attempt=1, layer="inprocess"),
        ev(RESTART_BEGIN, 10.2, rank=1, attempt=1, layer="inprocess"),
        ev(RESTART_BEGIN, 11.0, rank=0, attempt=1, iteration=1, layer="inprocess"),
        ev(RESTART_BEGIN, 11.0, rank=1, attempt=1, iteration=1, layer="inprocess"),
        ev(RESTART_END, 11.5, rank=0, attempt=1, iteration=2, layer="inprocess"),
    ]
    out += steps(5, 7, 12.0, attempt=1, iteration=2)  # [12, 15]
    out += [
        ev(FAULT_DETECTED, 15.0, rank=0, cause="stuck", detector="watchdog", fault_rank=1),
        ev(RESTART_BEGIN, 15.1, rank=0, attempt=1, iteration=2, layer="inprocess"),
        ev(RESTART_BEGIN, 15.1, rank=1, attempt=1, iteration=2, layer="inprocess"),
    ]
    out += steps(8, 10, 16.0, attempt=1, iteration=3)  # [16, 19]
    out += [
        ev(FAULT_DETECTED, 20.0, rank=1, cause="RuntimeError", detector="exception", phase="data"),
        ev(RESTART_BEGIN, 20.1, rank=0, attempt=1, iteration=3, layer="inprocess"),
        ev(JOB_END, 22.0, rank=-1, status="failed"),
    ]
    return out


def test_phase_class_and_restarts_of_each_fault() -> None:
    r = compute(phased_run())
    save, step, stuck, data = r.faults
    assert (save.fault_class, save.phase, save.restarts) == ("crash", "save", 1)
    assert (step.fault_class, step.phase, step.restarts) == ("exception", "step", 2)
    assert (stuck.fault_class, stuck.phase, stuck.restarts) == ("hang", None, 1)
    assert (data.fault_class, data.phase, data.restarts) == ("exception", "data", 1)
    assert [f.steps_lost for f in r.faults] == [2, 1, 0, None]
    assert save.recovery_s == approx(3.0)  # [5, 8]: both ranks' first step after 6.5
    assert step.recovery_s == approx(3.0)  # [10, 13]
    assert stuck.recovery_s == approx(2.0)  # [15, 17]
    assert data.recovery_s is None


def test_figures_per_class() -> None:
    r = compute(phased_run())
    assert list(r.by_class) == ["exception", "hang", "crash"]  # CLASSES order
    exc = r.by_class["exception"]
    assert (exc.faults, exc.recovered) == (2, 1)
    assert exc.recovery_rate == 0.5  # the fault never recovered counts against it
    assert exc.recovery_s_p50 == exc.recovery_s_p95 == exc.recovery_s_max == approx(3.0)
    assert exc.restarts == 3
    assert exc.failed_restarts == 1 + 1  # the second round's first try; the unrecovered one's
    assert (exc.steps_lost, exc.steps_lost_max, exc.steps_lost_mean) == (1, 1, 1.0)
    assert exc.detection_s_p50 == approx((0.1 + 0.0) / 2)
    crash = r.by_class["crash"]
    assert (crash.faults, crash.recovered, crash.recovery_rate) == (1, 1, 1.0)
    assert (crash.restarts, crash.failed_restarts) == (1, 0)  # two agents, one round
    assert (crash.steps_lost, crash.steps_lost_max, crash.steps_lost_mean) == (2, 2, 2.0)
    assert crash.detection_s_p50 == approx(0.25)
    hang = r.by_class["hang"]
    assert (hang.faults, hang.recovered, hang.failed_restarts, hang.steps_lost) == (1, 1, 0, 0)


def test_figures_per_phase() -> None:
    r = compute(phased_run())
    assert list(r.by_phase) == ["data", "step", "save", "unknown"]  # phase order, unknown last
    assert r.by_phase["save"].faults == 1 and r.by_phase["save"].steps_lost == 2
    assert r.by_phase["step"].failed_restarts == 1
    assert r.by_phase["data"].recovery_rate == 0.0 and r.by_phase["data"].recovered == 0
    assert r.by_phase["data"].recovery_s_p50 is None and r.by_phase["data"].steps_lost_max is None
    assert r.by_phase["unknown"].faults == 1


def test_summary_over_several_reports_pools_the_faults() -> None:
    a, b = compute(phased_run()), compute(phased_run())
    both = by_class([*a.faults, *b.faults])
    assert both["exception"].faults == 4 and both["exception"].recovered == 2
    assert both["exception"].failed_restarts == 4
    assert both["crash"].steps_lost == 4 and both["crash"].steps_lost_mean == 2.0
    assert by_phase([*a.faults, *b.faults])["save"].faults == 2


def test_recovery_quantiles_over_a_class() -> None:
    """Five crashes recovered in 1..5 s: p50 3, p95 4.8, max 5."""
    out = [*steps(0, 1, 0.0)]
    t, step = 2.0, 2
    for k in range(5):
        out += [
            ev(FAULT_INJECTED, t, rank=1, attempt=k, fault="sigkill", step=step),
            ev(RESTART_BEGIN, t, rank=-1, attempt=k, layer="launcher", round=k + 1),
            ev(RESTART_END, t + k, rank=-1, attempt=k + 1, layer="launcher"),
        ]
        out += steps(step, step, t + k, attempt=k + 1)  # ends at fault + k + 1
        t, step = t + k + 2, step + 1
    r = compute(out)
    assert [f.recovery_s for f in r.faults] == [approx(x) for x in (1, 2, 3, 4, 5)]
    crash = r.by_class["crash"]
    assert crash.recovery_s_p50 == approx(3.0)
    assert crash.recovery_s_p95 == approx(4.8)
    assert crash.recovery_s_max == approx(5.0)
    assert (crash.restarts, crash.failed_restarts) == (5, 0)


def test_a_non_disruptive_fault_is_recovered_without_a_recovery_time() -> None:
    out = [
        *steps(0, 2, 0.0),
        ev(FAULT_INJECTED, 3.0, rank=0, fault="slow-storage", step=2, disruptive=False),
        *steps(3, 5, 3.0),
    ]
    r = compute(out)
    storage = r.by_class["storage"]
    assert (storage.faults, storage.recovered, storage.recovery_rate) == (1, 1, 1.0)
    assert storage.recovery_s_p50 is None and storage.failed_restarts == 0
    assert r.faults[0].phase == "step"


def test_no_faults_no_groups_and_the_json_holds_them() -> None:
    assert compute(steps(0, 3, 0.0)).by_class == {}
    r = compute(phased_run())
    d = json.loads(json.dumps(r.to_dict()))
    assert d["by_class"]["exception"]["recovery_rate"] == 0.5
    assert d["by_phase"]["save"]["steps_lost"] == 2
    assert d["faults"][0]["fault_class"] == "crash" and d["faults"][0]["phase"] == "save"
    assert [FaultRecord.from_dict(f) for f in d["faults"]] == r.faults


def test_a_launcher_that_gives_up_tried_no_restart() -> None:
    """The agent writes restart_begin as it stops the workers; when its budget is spent it ends
    the job instead: that round is no failed restart."""
    events = [
        *steps(0, 2, 0.0),
        ev(FAULT_INJECTED, 3.0, rank=0, fault="exception", step=3),
        ev(RESTART_BEGIN, 3.1, rank=0, layer="inprocess"),  # tried in-process, escalated
        ev(RESTART_BEGIN, 3.1, rank=1, layer="inprocess"),
        ev(RESTART_BEGIN, 3.5, rank=-1, layer="launcher", round=0),
        ev(JOB_END, 3.6, rank=-1, status="failed", reason="restart_budget_exhausted", round=0),
    ]
    [f] = compute(events).faults
    assert f.restarts == 1
    assert compute(events).by_class["exception"].failed_restarts == 1
    ok = [*events[:-1], ev(JOB_END, 3.6, rank=-1, status="ok", round=0)]
    assert compute(ok).faults[0].restarts == 2
