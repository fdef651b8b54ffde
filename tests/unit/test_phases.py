"""Named phases: the announcements (``ledger.phases``), the fault plan's phase targets and the
injector that fires them, and the watchdog's per-phase timeouts (a fake clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sinks import Sink
from unbroken.faults import FaultInjector, InjectedFault, parse_plan
from unbroken.ledger import events as ev
from unbroken.ledger import phases
from unbroken.restart import RestartConfig
from unbroken.restart.calibrate import Calibrator
from unbroken.restart.watchdog import HANG, NONE, RESTART, Watchdog


def test_a_region_is_on_the_stack_and_heard_on_entry() -> None:
    heard: list[tuple[str, tuple[str, ...]]] = []
    with phases.listening(lambda name: heard.append((name, phases.active()))):
        with phases.region("validation"):
            phases.entered("persist")
        with phases.region("data"):
            pass
    with phases.region("data"):  # nobody listens any more
        pass
    assert heard == [
        ("validation", ("validation",)),
        ("persist", ("validation", "persist")),
        ("data", ("data",)),
    ]
    assert phases.active() == ()


def test_a_listener_that_raises_leaves_the_stack_clean() -> None:
    def boom(name: str) -> None:
        raise InjectedFault(name)

    with phases.listening(boom), pytest.raises(InjectedFault), phases.region("save"):
        pass
    assert phases.active() == ()


@pytest.mark.parametrize("name", ["", "1st", "lunch break", "a" * 65, "x,y", None, 3])
def test_bad_phase_names_are_refused(name: object) -> None:
    with pytest.raises(ValueError, match="not valid"):
        phases.check_name(name)


def test_plan_entries_name_a_phase_with_a_step_or_an_occurrence() -> None:
    plan = parse_plan(
        {
            "faults": [
                {"phase": "data", "step": 12, "rank": 0, "kind": "exception"},
                {"phase": "restore", "occurrence": 2, "rank": 1, "kind": "sigkill"},
                {"phase": "init", "rank": 0, "kind": "exception"},
                {"step": 3, "rank": 0, "kind": "hang"},
            ]
        }
    )
    assert [f.when() for f in plan.faults] == [
        "phase init",
        "phase restore #2",
        "step 3",
        "phase data after step 12",
    ]
    assert plan.at(12, 0) == []  # a phase target is not a step target
    assert [f.kind for f in plan.at(3, 0)] == ["hang"]
    assert sorted(plan.in_phase(0)) == ["data", "init"]
    again = parse_plan({"faults": [f.to_entry() for f in plan.faults]})
    assert [f.to_entry() for f in again.faults] == [f.to_entry() for f in plan.faults]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"rank": 0, "kind": "exception"}, "lacks \\['step'\\]"),
        ({"phase": "x y", "rank": 0, "kind": "exception"}, "not valid"),
        ({"occurrence": 1, "step": 2, "rank": 0, "kind": "exception"}, "needs a phase"),
        ({"phase": "data", "occurrence": 1, "step": 2, "rank": 0, "kind": "exception"}, "not both"),
        ({"phase": "data", "occurrence": 0, "rank": 0, "kind": "exception"}, "occurrence must"),
        ({"phase": "data", "occurrence": "2", "rank": 0, "kind": "exception"}, "occurrence must"),
    ],
)
def test_bad_phase_entries_say_what_is_wrong(entry: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_plan({"faults": [entry]})


def _injector(tmp_path: Path, faults: list[dict], rank: int = 0) -> tuple[FaultInjector, Sink]:
    sink = Sink()
    plan = parse_plan({"faults": faults})
    return FaultInjector(plan, run_dir=tmp_path, rank=rank, sink=sink), sink


def test_a_step_target_fires_at_the_first_entry_once_the_step_is_done(tmp_path: Path) -> None:
    inj, sink = _injector(tmp_path, [{"phase": "data", "step": 4, "rank": 0, "kind": "exception"}])
    inj.on_phase("data")  # no step done yet
    for step in range(4):
        inj.on_step(step)
        inj.on_phase("data")
        inj.on_phase("validation")  # another phase
    inj.on_step(4)
    with pytest.raises(InjectedFault, match="phase data after step 4"):
        inj.on_phase("data")
    inj.on_phase("data")  # once per run
    (record,) = [d for kind, d in sink.events if kind == ev.FAULT_INJECTED]
    assert record["phase"] == "data" and record["step"] == 4


def test_an_occurrence_counts_entries_across_processes(tmp_path: Path) -> None:
    fault = [{"phase": "restore", "occurrence": 3, "rank": 1, "kind": "exception"}]
    first, _ = _injector(tmp_path, fault, rank=1)
    first.on_phase("restore")
    first.on_phase("restore")
    again, sink = _injector(tmp_path, fault, rank=1)  # a restarted process counts on
    with pytest.raises(InjectedFault, match="phase restore #3"):
        again.on_phase("restore")
    other, _ = _injector(tmp_path, fault, rank=0)  # another rank's count is its own
    for _ in range(5):
        other.on_phase("restore")
    assert json.loads((tmp_path / "faults" / "fired" / "0.json").read_text())["phase"] == "restore"
    assert [d["phase"] for kind, d in sink.events if kind == ev.FAULT_INJECTED] == ["restore"]


def test_several_ranks_may_fault_at_one_step(tmp_path: Path) -> None:
    faults = [
        {"step": 5, "rank": 0, "kind": "exception"},
        {"step": 5, "rank": 1, "kind": "exception"},
    ]
    for rank in (0, 1):
        inj, _ = _injector(tmp_path, faults, rank=rank)
        with pytest.raises(InjectedFault, match=f"rank {rank}"):
            inj.on_step(5)


CFG = RestartConfig(
    soft_timeout_s=1.0,
    hard_timeout_s=3.0,
    initial_soft_timeout_s=10.0,
    initial_hard_timeout_s=20.0,
    exit_timeout_s=2.0,
    barrier_timeout_s=30.0,
    monitor_interval_s=0.01,
    phase_timeouts_s={"validation": 5.0},
)


def _running(config: RestartConfig = CFG) -> Watchdog:
    w = Watchdog(config)
    w.arm(0.0)
    w.progress(0.1, step=True)
    return w


def test_inside_a_phase_its_own_timeout_applies() -> None:
    w = _running()
    w.enter_phase("validation", 1.0)
    assert w.evaluate(4.0, silent_s=0.0).action == NONE  # 3 s: past the step's 1 s
    v = w.evaluate(6.5, silent_s=0.0)
    assert (v.action, v.kind, v.phase) == (RESTART, HANG, "validation")
    assert "hang in phase validation" in v.describe()
    w.progress(6.0, step=False)  # a heartbeat inside the phase restarts its clock
    assert w.evaluate(10.0, silent_s=0.0).action == NONE
    w.exit_phase("validation", 10.5)
    assert w.evaluate(11.0, silent_s=0.0).action == NONE
    assert w.evaluate(11.6, silent_s=0.0).action == RESTART  # the step's 1 s again


def test_a_phase_not_named_is_calibrated_from_its_durations() -> None:
    cfg = RestartConfig(**{**CFG.__dict__, "phase_timeouts_s": {}})
    sink = Sink()
    w = Watchdog(cfg, Calibrator(cfg, ledger=sink))
    w.arm(0.0)
    w.progress(0.1, step=True)
    assert w.calibrator.phase_timeouts("data")[0] == 10.0  # not seen yet: the initial ceiling
    w.enter_phase("data", 1.0)
    w.exit_phase("data", 1.5)
    assert w.calibrator.phase_timeouts("data")[0] == pytest.approx(4.0)  # 8 x 0.5 s
    w.enter_phase("data", 2.0)
    w.exit_phase("data", 2.01)  # shorter: the longest stays
    assert w.calibrator.phase_timeouts("data")[0] == pytest.approx(4.0)
    tuned = [d for kind, d in sink.events if kind == ev.TUNED]
    assert [(d["name"], d["phase"], d["value"]) for d in tuned] == [
        ("phase_soft_timeout_s", "data", 4.0)
    ]


def test_phase_time_is_no_step_gap() -> None:
    cfg = RestartConfig(**{**CFG.__dict__, "soft_timeout_s": None, "timeout_warmup": 1})
    w = Watchdog(cfg)
    w.arm(0.0)
    w.progress(0.1, step=True)
    w.enter_phase("validation", 0.2)
    w.exit_phase("validation", 5.2)
    w.progress(5.3, step=True)  # a 5.2 s gap, 5 s of it a phase: the step took 0.2 s
    assert w.calibrator.gaps.max == pytest.approx(0.2)


def test_calibrated_phases_survive_a_restarted_process(tmp_path: Path) -> None:
    cfg = RestartConfig(**{**CFG.__dict__, "phase_timeouts_s": {}})
    first = Calibrator(cfg, path=tmp_path / "rank0.json")
    first.phase_ended("validation", 1.0)
    again = Calibrator(cfg, path=tmp_path / "rank0.json")
    assert again.phase_timeouts("validation")[0] == pytest.approx(8.0)


def test_a_bad_phase_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"phase_timeouts_s\['data'\] must be"):
        RestartConfig(phase_timeouts_s={"data": 0.0})
