"""Goodput math on hand-built timelines; every expected number is derived from the timeline."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from unbroken.ledger.events import (
    CKPT_COMMIT,
    CKPT_LOAD,
    CKPT_PERSIST,
    CKPT_STAGE,
    ESCALATE,
    FAULT_DETECTED,
    FAULT_INJECTED,
    JOB_END,
    PHASE,
    PROCESS_START,
    RESTART_BEGIN,
    RESTART_END,
    STEP,
    WORKER_EXIT,
    Event,
)
from unbroken.ledger.goodput import BADPUT_CATEGORIES, RunReport, compute

RUN = "run-1"


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-9)


# --- compact constructors ----------------------------------------------------------------------
def ev(kind: str, ts: float, *, rank: int = 0, attempt: int = 0, iteration: int = 0, **data):
    return Event(
        kind=kind, ts=ts, run=RUN, rank=rank, attempt=attempt, iteration=iteration, data=data
    )


def span(kind: str, begin: float, end: float, **kw) -> Event:
    """An interval record covering [begin, end]."""
    return ev(kind, end, dur_s=end - begin, **kw)


def phase(name: str, begin: float, end: float, **kw) -> Event:
    return span(PHASE, begin, end, name=name, **kw)


def steps(first: int, last: int, start: float, *, dur: float = 1.0, **kw) -> list[Event]:
    """Steps ``first..last`` back to back from ``start``, each ``dur`` seconds."""
    out = []
    for k, n in enumerate(range(first, last + 1)):
        end = start + (k + 1) * dur
        out.append(ev(STEP, end, dur_s=dur, step=n, loss=1.0, **kw))
    return out


def check_partition(r: RunReport) -> None:
    assert set(r.badput_s) == set(BADPUT_CATEGORIES)
    assert all(v >= -1e-12 for v in r.badput_s.values())
    assert r.productive_s + sum(r.badput_s.values()) == approx(r.wall_s)


def plain_run(rank: int = 0) -> list[Event]:
    return [
        phase("import", 0.0, 1.0, rank=rank),
        phase("pg_init", 1.0, 1.5, rank=rank),
        phase("model_build", 1.5, 2.0, rank=rank),
        *steps(0, 9, 2.0, rank=rank),
    ]


# --- 1. plain run -------------------------------------------------------------------------------
def test_plain_run():
    r = compute([*plain_run(), ev(JOB_END, 12.5, rank=-1, status="ok")])
    check_partition(r)
    assert r.run == RUN
    assert r.wall_s == approx(12.5)
    assert r.productive_s == approx(10.0)
    assert r.training_goodput == approx(0.8)
    assert r.steps_completed == 10
    assert r.badput_s["startup"] == approx(1.0)
    assert r.badput_s["pg_init"] == approx(0.5)
    assert r.badput_s["model_build"] == approx(0.5)
    assert r.badput_s["other"] == approx(0.5)
    for name in ("reexecuted", "detection", "recovery", "checkpoint_save", "checkpoint_load"):
        assert r.badput_s[name] == 0.0
    assert r.ettr == approx(10 / 11.5)
    assert r.infra_goodput == r.availability == 1.0
    assert r.checkpoint_efficiency == 1.0  # loop of 10 s, no save
    assert r.loop_s == approx(10.0)
    assert r.faults == []
    assert r.num_attempts == 1 and r.num_iterations == 1
    assert r.step_time_s_median == approx(1.0)
    assert r.recovery_s_median is None and r.recovery_s_max is None
    assert r.fault_s == 0.0


# --- 2. two ranks -------------------------------------------------------------------------------
def test_other_ranks_do_not_change_reference_figures():
    rank0 = [*plain_run(), ev(JOB_END, 12.5, rank=-1)]
    # Rank 1: slower phases, steps ending 0.2 s later, and a save of its own: all ignored.
    rank1 = [
        phase("import", 0.0, 1.3, rank=1),
        phase("pg_init", 1.3, 1.6, rank=1),
        *steps(0, 9, 2.2, rank=1),
        span(CKPT_STAGE, 5.0, 5.2, rank=1, step=3),
    ]
    alone, both = compute(rank0), compute(rank0 + rank1)
    assert both.productive_s == approx(10.0)
    assert both.badput_s == alone.badput_s
    assert both.steps_completed == 10
    # Reference rank 1 reads rank 1's timeline: 10 steps from 2.2 to 12.2, save 0.2 s inside.
    r1 = compute(rank0 + rank1, reference_rank=1)
    check_partition(r1)
    assert r1.productive_s == approx(10.0 - 0.2)
    assert r1.badput_s["checkpoint_save"] == approx(0.2)
    assert r1.badput_s["startup"] == approx(1.3)


def test_recovered_ts_is_max_over_ranks():
    events = []
    for rank, lag in ((0, 0.0), (1, 0.1), (2, 0.2)):
        events += steps(0, 3, lag, rank=rank)  # steps 0..3 end at 1..4 (+lag)
    events += [
        ev(FAULT_INJECTED, 4.5, rank=2, fault="exception", step=4, index=0),
        ev(FAULT_DETECTED, 4.6, rank=2, cause="exception", detector="exception", layer="inprocess"),
        ev(RESTART_BEGIN, 4.7, rank=0, layer="inprocess"),
        ev(RESTART_END, 5.0, rank=0, layer="inprocess"),
    ]
    # Iteration 1: first steps end at 6.5 (rank 0), 6.8 (rank 1), 7.1 (rank 2).
    events += steps(4, 5, 5.5, rank=0, iteration=1)
    events += [
        span(STEP, 5.6, 6.8, rank=1, iteration=1, step=4),
        span(STEP, 5.9, 7.1, rank=2, iteration=1, step=4),
    ]
    r = compute(events)
    check_partition(r)
    [f] = r.faults
    assert f.injected and f.kind == "exception" and f.rank == 2 and f.step == 4
    assert f.layer == "inprocess" and f.detector == "exception" and f.cause == "exception"
    assert f.detection_s == approx(0.1)
    assert f.downtime_s == approx(1.0)  # threshold = restart_end 5.0; rank-0 step 4 begins 5.5
    assert f.recovery_s == approx(7.1 - 4.5)
    assert f.steps_lost == 0  # last before = 3, resumes at 4
    assert f.restore_tier is None and f.restored_step is None
    assert r.num_iterations == 2 and r.num_attempts == 1
    assert r.steps_completed == 6
    assert r.recovery_s_max == approx(2.6) and r.recovery_s_median == approx(2.6)


# --- 3. fault with rollback ---------------------------------------------------------------------
def rollback_run() -> list[Event]:
    events = []
    for rank in (0, 1):
        events += [
            phase("import", 0.0, 1.0, rank=rank),
            phase("pg_init", 1.0, 1.5, rank=rank),
            phase("model_build", 1.5, 2.0, rank=rank),
            *steps(0, 7, 2.0, rank=rank),  # steps 0..7 over [2, 10]
        ]
    events += [
        ev(FAULT_INJECTED, 10.0, rank=1, fault="exception", step=7, index=0),
        ev(FAULT_DETECTED, 10.2, rank=-1, cause="exception", detector="exit_code", fault_rank=1),
        ev(RESTART_BEGIN, 10.3, rank=-1, layer="launcher", cause="exception"),
        ev(WORKER_EXIT, 10.4, rank=-1, exit_code=1, signal=None),
        ev(RESTART_END, 11.0, rank=-1, attempt=1, layer="launcher"),
    ]
    a1 = {"attempt": 1}
    for rank in (0, 1):
        events += [
            phase("import", 10.5, 10.8, rank=rank, **a1),
            phase("pg_init", 10.8, 11.0, rank=rank, **a1),
            phase("model_build", 11.0, 11.5, rank=rank, **a1),
            span(CKPT_LOAD, 11.5, 12.0, rank=rank, step=5, tier="disk", **a1),
        ]
    events += steps(5, 9, 12.0, rank=0, **a1)  # [12, 17]
    events += steps(5, 9, 12.1, rank=1, **a1)  # first ends at 13.1
    events.append(ev(JOB_END, 17.5, rank=-1, attempt=1, status="ok"))
    return events


def test_fault_with_rollback():
    r = compute(rollback_run())
    check_partition(r)
    assert r.wall_s == approx(17.5)
    assert r.productive_s == approx(10.0)  # steps 0..4 [2, 7] and 5..9 [12, 17]
    assert r.steps_completed == 10
    b = r.badput_s
    assert b["reexecuted"] == approx(3.0)  # first runs of 5, 6, 7: [7, 10]
    assert b["detection"] == approx(0.2)  # [10, 10.2]
    assert b["recovery"] == approx(0.3)  # [10.2, 12] minus phases and load from 10.5
    assert b["startup"] == approx(1.0 + 0.3)
    assert b["pg_init"] == approx(0.5 + 0.2)
    assert b["model_build"] == approx(0.5 + 0.5)
    assert b["checkpoint_load"] == approx(0.5)
    assert b["other"] == approx(0.5)  # [17, 17.5]
    assert r.training_goodput == approx(10 / 17.5)
    assert r.infra_goodput == approx(1 - 1.8 / 17.5)  # detection to resume: [10.2, 12]
    assert r.availability == approx(1 - 2.0 / 17.5)  # fault to resume: [10, 12]
    assert r.ettr == approx(10 / (17.5 - 1.0))  # only the first launch's import is excluded
    # What the fault cost: its window [10, 12] (the restarted process's phases and load in it
    # included) and the re-executed [7, 10].
    assert r.fault_s == approx(2.0 + 3.0)
    assert r.loop_s == approx(8.0 + 5.0)
    assert r.checkpoint_efficiency == 1.0
    assert r.num_attempts == 2 and r.num_iterations == 1
    [f] = r.faults
    assert f.index == 0 and f.injected and f.kind == "exception" and f.rank == 1 and f.step == 7
    assert f.cause == "exception" and f.detector == "exit_code" and f.layer == "launcher"
    assert f.fault_ts == 10.0
    assert f.detection_s == approx(0.2)
    assert f.downtime_s == approx(2.0)  # resumes at step 5's begin, 12.0
    assert f.recovery_s == approx(3.1)  # rank 1's first step ends at 13.1
    assert f.steps_lost == 3  # step 7 done at the fault, resumed at 5: 5, 6, 7 lost
    assert f.restore_tier == "disk" and f.restored_step == 5
    assert r.recovery_s_median == approx(3.1) and r.recovery_s_max == approx(3.1)


# --- 4. overlapping async saves -----------------------------------------------------------------
def test_a_step_ending_on_the_reference_rank_after_a_peers_fault_counts_as_lost():
    # Rank 1 is killed just after step 7's collectives, before rank 0 has written step 7's
    # record (10.0): rank 0 ended step 7 before the fault was detected, so it was done.
    events = [
        ev(FAULT_INJECTED, 9.95, rank=1, fault="exception", step=7, index=0)
        if e.kind == FAULT_INJECTED
        else e
        for e in rollback_run()
    ]
    [f] = compute(events).faults
    assert f.fault_ts == 9.95 and f.steps_lost == 3  # 5, 6, 7


def test_a_step_ending_after_the_detection_is_not_counted_as_done():
    events = [e for e in rollback_run() if not (e.kind == STEP and e.rank == 0 and e.ts == 10.0)]
    events.append(ev(STEP, 10.25, dur_s=1.0, step=7, loss=1.0))  # after the detection (10.2)
    [f] = compute(events).faults
    assert f.steps_lost == 2  # 5, 6


def test_async_saves_blocking_part_only():
    events = steps(0, 9, 0.0)  # [0, 10]
    events += [
        span(CKPT_STAGE, 4.9, 5.0, step=4, bytes=1),
        span(CKPT_PERSIST, 5.0, 6.5, step=4, bytes=1),
        ev(CKPT_COMMIT, 6.5, step=4),
        span(CKPT_STAGE, 7.9, 8.0, step=7, bytes=1),
        span(CKPT_PERSIST, 8.0, 9.5, step=7, bytes=1),
        ev(CKPT_COMMIT, 9.5, step=7),
        span(CKPT_STAGE, 10.0, 10.5, step=9, bytes=1),  # final save, outside any step
        span(CKPT_PERSIST, 10.5, 11.0, step=9, bytes=1),
        ev(CKPT_COMMIT, 11.0, step=9),
        span(CKPT_STAGE, 3.0, 3.5, rank=1, step=2),  # another rank's save: ignored
        ev(JOB_END, 11.0, rank=-1),
    ]
    r = compute(events)
    check_partition(r)
    assert r.wall_s == approx(11.0)
    assert r.checkpoint_save_s == approx(0.1 + 0.1 + 0.5)
    assert r.badput_s["checkpoint_save"] == approx(0.7)
    assert r.productive_s == approx(10.0 - 0.2)
    assert r.badput_s["other"] == approx(0.5)  # waiting for the last persist: not a save
    assert r.loop_s == approx(10.5)
    assert r.checkpoint_efficiency == approx(1 - 0.7 / 10.5)
    assert r.training_goodput == approx(9.8 / 11.0)
    assert r.steps_completed == 10


def test_priorities_between_overlapping_categories():
    events = [
        *steps(0, 3, 0.0),  # [0, 4]
        phase("data", 0.5, 1.5),  # beats productive
        span(CKPT_LOAD, 2.0, 3.0, step=0, tier="memory"),
        span(CKPT_STAGE, 2.5, 3.5, step=1),  # beats the load over [2.5, 3]
        phase("rendezvous", 4.0, 5.0),
        phase("import", 4.5, 5.5),  # overlapping phases: the first in category order wins
    ]
    r = compute(events)
    check_partition(r)
    assert r.badput_s["startup"] == approx(1.0)
    assert r.badput_s["rendezvous"] == approx(0.5)
    assert r.badput_s["data"] == approx(1.0)
    assert r.badput_s["checkpoint_load"] == approx(0.5)
    assert r.badput_s["checkpoint_save"] == approx(1.0)
    assert r.productive_s == approx(4.0 - 1.0 - 0.5 - 1.0)


def test_surviving_step_beats_rolled_back_one_where_they_overlap():
    # Step 3 runs [3, 4], then again (after an unrecorded rollback) as [3.5, 5] (its dur_s runs
    # from the previous boundary it saw): the overlap [3.5, 4] is productive.
    events = [*steps(0, 3, 0.0), span(STEP, 3.5, 5.0, iteration=1, step=3)]
    r = compute(events)
    check_partition(r)
    assert r.productive_s == approx(3.0 + 1.5)
    assert r.badput_s["reexecuted"] == approx(0.5)
    assert r.steps_completed == 4
    assert r.step_time_s_median == approx(1.0)  # durations 1, 1, 1, 1.5


def test_restart_end_holds_back_resume():
    events = [
        *steps(0, 2, 0.0),  # [0, 3]
        ev(FAULT_INJECTED, 3.0, rank=1, fault="exception", step=3),
        ev(FAULT_DETECTED, 3.1, rank=1, cause="exception", detector="exception"),
        span(STEP, 3.2, 4.2, step=3),  # under way when the restart ended at 4.0: no resume
        ev(RESTART_END, 4.0, rank=0, layer="inprocess"),
        *steps(4, 4, 4.2, iteration=1),  # [4.2, 5.2]: the first step beginning after 4.0
    ]
    r = compute(events)
    check_partition(r)
    [f] = r.faults
    assert f.downtime_s == approx(1.2)
    assert f.recovery_s == approx(2.2)
    assert f.steps_lost == 0  # step 2 done before the fault, resumed at 4
    assert r.badput_s["detection"] == approx(0.1)
    assert r.badput_s["recovery"] == approx(0.1)  # [3.1, 4.2] less step 3's [3.2, 4.2]
    assert r.productive_s == approx(5.0)


# --- 5. natural fault, and a fault never resumed ------------------------------------------------
def test_natural_fault():
    events = [
        *steps(0, 4, 0.0),  # [0, 5]
        ev(FAULT_DETECTED, 5.5, rank=-1, cause="hang", detector="watchdog", fault_rank=1),
        ev(RESTART_BEGIN, 5.6, rank=0, layer="inprocess"),
        ev(RESTART_END, 6.0, rank=0, layer="inprocess"),
        *steps(5, 6, 6.5, iteration=1),  # [6.5, 8.5]
        ev(JOB_END, 8.5, rank=-1),
    ]
    r = compute(events)
    check_partition(r)
    [f] = r.faults
    assert not f.injected and f.kind == "hang" and f.cause == "hang" and f.step is None
    assert f.rank == 1 and f.detector == "watchdog" and f.layer == "inprocess"
    assert f.fault_ts == 5.5 and f.detection_s == 0.0
    assert f.downtime_s == approx(1.0)
    assert f.recovery_s == approx(2.0)
    assert f.steps_lost == 0
    assert f.restore_tier is None
    assert r.badput_s["recovery"] == approx(1.0)  # [5.5, 6.5]
    assert r.badput_s["other"] == approx(0.5)  # [5, 5.5]: before anyone noticed
    assert r.badput_s["detection"] == 0.0
    assert r.productive_s == approx(7.0)
    assert r.infra_goodput == r.availability == approx(1 - 1.0 / 8.5)


def test_fault_never_resumed():
    events = [
        *steps(0, 4, 0.0),  # [0, 5]
        ev(FAULT_INJECTED, 5.0, rank=1, fault="sigkill", step=5, index=0),
        ev(FAULT_DETECTED, 5.3, rank=-1, cause="signal", detector="exit_code"),
        ev(RESTART_BEGIN, 5.4, rank=-1, layer="launcher"),
        ev(WORKER_EXIT, 5.5, rank=-1, exit_code=-9, signal=9),
        span(CKPT_LOAD, 6.0, 6.5, attempt=1, step=3, tier="memory"),
        ev(ESCALATE, 7.0, rank=-1, reason="max restarts"),
        ev(JOB_END, 8.0, rank=-1, status="failed"),
    ]
    r = compute(events)
    check_partition(r)
    [f] = r.faults
    assert f.recovery_s is None and f.downtime_s is None and f.steps_lost is None
    assert f.detection_s == approx(0.3)
    assert f.layer == "launcher"  # from the restart, the detection named none
    assert f.restore_tier == "memory" and f.restored_step == 3
    assert r.infra_goodput == approx(1 - 2.7 / 8.0)  # [5.3, t1]
    assert r.availability == approx(1 - 3.0 / 8.0)  # [5, t1]
    assert r.badput_s["detection"] == approx(0.3)
    assert r.badput_s["checkpoint_load"] == approx(0.5)
    assert r.badput_s["recovery"] == approx(2.7 - 0.5)  # [5.3, 8] less the load
    assert r.badput_s["other"] == 0.0
    assert r.recovery_s_median is None and r.recovery_s_max is None
    assert r.training_goodput == approx(5.0 / 8.0)


# --- 6. overlapping faults ----------------------------------------------------------------------
def test_overlapping_faults_use_union():
    events = [
        *steps(0, 4, 0.0),  # [0, 5]
        ev(FAULT_INJECTED, 5.0, rank=1, fault="hang", step=5, index=0),
        ev(FAULT_DETECTED, 5.2, rank=-1, cause="heartbeat", detector="heartbeat"),
        ev(FAULT_INJECTED, 5.5, rank=2, fault="sigterm", step=5, index=1),
        ev(FAULT_DETECTED, 5.8, rank=-1, cause="signal", detector="exit_code"),
        ev(RESTART_END, 6.5, rank=-1, attempt=1, layer="launcher"),
        *steps(5, 6, 7.0, attempt=1),  # [7, 9]
    ]
    r = compute(events)
    check_partition(r)
    a, b = r.faults
    assert (a.index, a.rank, a.kind, a.detector) == (0, 1, "hang", "heartbeat")
    assert (b.index, b.rank, b.kind, b.detector) == (1, 2, "sigterm", "exit_code")
    assert a.detection_s == approx(0.2) and b.detection_s == approx(0.3)
    assert a.layer == b.layer == "launcher"
    assert a.downtime_s == approx(2.0) and b.downtime_s == approx(1.5)
    assert a.recovery_s == approx(3.0) and b.recovery_s == approx(2.5)
    assert r.infra_goodput == approx(1 - 1.8 / 9.0)  # union [5.2, 7], not 3.0 s
    assert r.availability == approx(1 - 2.0 / 9.0)  # union [5, 7], not 3.5 s
    assert r.badput_s["detection"] == approx(0.2 + 0.3)
    assert r.badput_s["recovery"] == approx(0.3 + 1.2)  # [5.2, 5.5] and [5.8, 7]
    assert r.recovery_s_median == approx(2.75) and r.recovery_s_max == approx(3.0)
    assert r.fault_s == approx(2.0)  # the union [5, 7], once


def test_fault_cost_excludes_saves_and_surviving_steps_in_its_window():
    events = [
        *steps(0, 3, 0.0),  # [0, 4]
        span(STEP, 4.0, 5.5, step=4),  # a step that ends after the fault and survives
        ev(FAULT_INJECTED, 5.0, rank=1, fault="exception", step=4),
        ev(FAULT_DETECTED, 5.5, rank=1, cause="exception", detector="exception"),
        span(CKPT_STAGE, 5.6, 5.8, step=4),  # the rescue's snapshot: a save, not the fault's
        phase("import", 6.0, 6.5),  # a restarted process's start-up: the fault's
        *steps(5, 6, 7.0),  # resumes at 7
    ]
    r = compute(events)
    check_partition(r)
    assert r.badput_s["startup"] == approx(0.5)  # the partition still names the phase
    # [5, 7] less the step's [5, 5.5] and the save's [5.6, 5.8]
    assert r.fault_s == approx(2.0 - 0.5 - 0.2)
    assert r.productive_s + r.checkpoint_save_s + r.fault_s <= r.wall_s + 1e-9


def test_detection_before_injection_opens_natural_fault():
    events = [
        *steps(0, 1, 0.0),
        ev(FAULT_DETECTED, 2.1, rank=-1, cause="nan", detector="loss_check"),
        ev(FAULT_INJECTED, 2.2, rank=0, fault="exception", step=2),
        ev(RESTART_END, 3.0, rank=0, layer="inprocess"),
        *steps(2, 2, 3.0, iteration=1),  # [3, 4]: begins exactly at the threshold, resumes
    ]
    r = compute(events)
    natural, injected = r.faults
    assert not natural.injected and natural.fault_ts == 2.1 and natural.kind == "nan"
    assert injected.injected and injected.detection_s is None and injected.cause is None
    # Both closed by the same step (no detection or restart holds the injected one back).
    assert natural.downtime_s == approx(0.9) and injected.downtime_s == approx(0.8)


def test_detection_attaches_to_oldest_open_fault_and_the_restart_names_the_layer():
    events = [
        *steps(0, 1, 0.0),
        ev(FAULT_INJECTED, 2.0, rank=1, fault="hang", step=2),
        ev(FAULT_INJECTED, 2.1, rank=2, fault="exception", step=2),
        ev(FAULT_DETECTED, 2.5, rank=-1, cause="timeout", detector="heartbeat", layer="inprocess"),
        ev(RESTART_BEGIN, 2.6, rank=-1, layer="launcher"),
        ev(RESTART_END, 3.0, rank=-1, attempt=1, layer="launcher"),
        *steps(2, 2, 3.5, attempt=1),
    ]
    first, second = compute(events).faults
    assert first.rank == 1 and first.detector == "heartbeat" and first.detection_s == approx(0.5)
    assert second.rank == 2 and second.detector is None and second.detection_s is None
    # The detection said inprocess; the launcher's restart recovered both.
    assert first.layer == second.layer == "launcher"
    assert first.downtime_s == approx(1.5) and second.downtime_s == approx(1.4)


# --- 7. partition invariant on random timelines -------------------------------------------------
def random_run(rng: random.Random, *, ranks: int = 3, faults: int = 4) -> list[Event]:
    events: list[Event] = []
    t = 0.0
    step = 0
    for attempt in range(faults + 1):
        for name in ("import", "rendezvous", "pg_init", "model_build", "data"):
            d = rng.uniform(0.01, 0.5)
            for rank in range(ranks):
                jitter = rng.uniform(0, 0.05)
                events.append(phase(name, t + jitter, t + d + jitter, rank=rank, attempt=attempt))
            t += d
        if attempt:
            load = rng.uniform(0.05, 0.3)
            restored = max(0, step - rng.randint(0, 4))
            events.append(span(CKPT_LOAD, t, t + load, attempt=attempt, step=restored, tier="disk"))
            t += load
            step = restored
        for _ in range(rng.randint(3, 15)):
            d = rng.uniform(0.2, 1.0)
            for rank in range(ranks):
                lag = rng.uniform(0, 0.1)
                events.append(
                    span(STEP, t + lag, t + d + lag, rank=rank, attempt=attempt, step=step)
                )
            if rng.random() < 0.3:
                events.append(
                    span(CKPT_STAGE, t + d * 0.8, t + d * 1.1, attempt=attempt, step=step)
                )
            t += d
            step += 1
        if attempt < faults:
            t += rng.uniform(0, 0.3)
            events.append(ev(FAULT_INJECTED, t, rank=rng.randrange(ranks), fault="sigkill"))
            if rng.random() < 0.8:
                t += rng.uniform(0, 0.5)
                events.append(ev(FAULT_DETECTED, t, rank=-1, cause="signal", detector="exit_code"))
            events.append(ev(RESTART_BEGIN, t, rank=-1, attempt=attempt, layer="launcher"))
            t += rng.uniform(0.1, 1.0)
            events.append(ev(RESTART_END, t, rank=-1, attempt=attempt + 1, layer="launcher"))
    events.append(ev(JOB_END, t + rng.uniform(0, 1), rank=-1))
    return events


@pytest.mark.parametrize("seed", range(8))
def test_partition_invariant_random(seed):
    rng = random.Random(seed)
    events = random_run(rng)
    r = compute(events)
    check_partition(r)
    assert 0.0 <= r.training_goodput <= 1.0
    assert 0.0 <= r.infra_goodput <= 1.0
    assert r.checkpoint_efficiency is not None and 0.0 <= r.checkpoint_efficiency <= 1.0
    assert r.productive_s <= r.loop_s + 1e-9
    # The fault cost is disjoint from the productive and the blocking-save time.
    assert r.fault_s > 0.0
    assert r.productive_s + r.checkpoint_save_s + r.fault_s <= r.wall_s + 1e-9
    assert len(r.faults) == 4
    for f in r.faults:
        assert f.downtime_s is not None and f.recovery_s is not None
        assert 0.0 <= f.downtime_s <= f.recovery_s
        assert f.steps_lost is not None and f.steps_lost >= 0
    ref_steps = {e.data["step"] for e in events if e.kind == STEP and e.rank == 0}
    assert r.steps_completed == len(ref_steps)
    rng.shuffle(events)
    assert compute(events).to_dict() == r.to_dict()


@pytest.mark.slow
def test_large_run_is_fast_enough():
    # 100k records: the sweep must be O(n log n); a quadratic one would time out.
    events = []
    for rank in range(2):
        events += steps(0, 49_999, 0.0, dur=0.01, rank=rank)
    r = compute(events)
    assert r.steps_completed == 50_000
    assert r.productive_s == approx(r.wall_s)
    assert math.isclose(r.training_goodput, 1.0)


# --- 8. order, empty input, JSON ----------------------------------------------------------------
def test_order_does_not_matter():
    events = rollback_run()
    expected = compute(sorted(events, key=lambda e: e.ts)).to_dict()
    shuffled = list(events)
    random.Random(42).shuffle(shuffled)
    assert compute(shuffled).to_dict() == expected
    assert compute(list(reversed(events))).to_dict() == expected


def test_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        compute([])


def test_to_dict_is_plain_json():
    d = compute(rollback_run()).to_dict()
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
        "run",
        "num_attempts",
        "num_iterations",
        "checkpoint_save_s",
        "loop_s",
        "step_time_s_median",
        "recovery_s_median",
        "recovery_s_max",
    ):
        assert key in d
    assert isinstance(d["faults"], list) and isinstance(d["faults"][0], dict)
    assert d["faults"][0]["restore_tier"] == "disk"
    assert json.loads(json.dumps(d)) == d
    assert type(d["wall_s"]) is float and type(d["badput_s"]["other"]) is float


def test_ledger_math_does_not_import_torch():
    code = (
        "import sys, unbroken.ledger.goodput, unbroken.ledger.report; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_run_id_is_most_common():
    events = [*steps(0, 2, 0.0), Event(kind=JOB_END, ts=4.0, run="stray", rank=-1)]
    assert compute(events).run == RUN


def test_peer_detections_inside_an_outage_belong_to_it():
    # Rank 0 raises an injected exception; rank 1's collective then fails too. One outage.
    events = [
        *steps(0, 4, 0.0),  # [0, 5]
        ev(FAULT_INJECTED, 5.0, rank=0, fault="exception", step=4, index=0),
        ev(FAULT_DETECTED, 5.0, rank=0, cause="InjectedFault", detector="exception"),
        ev(FAULT_DETECTED, 5.1, rank=1, cause="RuntimeError", detector="exception"),
        *steps(0, 4, 7.0, attempt=1),  # [7, 12]
        # After the resume, a new detection is a new (natural) fault.
        ev(FAULT_DETECTED, 12.5, rank=1, cause="RuntimeError", detector="exception"),
        *steps(5, 5, 13.0, attempt=2),  # [13, 14]
    ]
    r = compute(events)
    check_partition(r)
    assert [(f.kind, f.injected) for f in r.faults] == [
        ("exception", True),
        ("RuntimeError", False),
    ]
    first, second = r.faults
    assert first.cause == "InjectedFault" and first.detection_s == approx(0.0)
    assert first.downtime_s == approx(2.0) and first.steps_lost == 5
    assert second.fault_ts == 12.5 and second.downtime_s == approx(0.5)


def test_a_killed_ranks_own_detection_names_the_cause_when_a_peer_saw_it_first():
    # Rank 1 is SIGKILLed; rank 0's collective fails a moment before its agent reaps rank 1.
    events = [
        *steps(0, 4, 0.0),  # [0, 5]
        ev(FAULT_INJECTED, 5.0, rank=1, fault="sigkill", step=4, index=0),
        ev(FAULT_DETECTED, 5.01, rank=0, cause="exception", detector="exception", fault_rank=0),
        ev(FAULT_DETECTED, 5.02, rank=-1, cause="sigkill", detector="exit", fault_rank=1),
        ev(FAULT_DETECTED, 5.03, rank=0, cause="exception", detector="exception", fault_rank=0),
        *steps(5, 9, 6.0, attempt=1),
    ]
    (fault,) = compute(events).faults
    assert (fault.cause, fault.detector) == ("sigkill", "exit")
    assert fault.detection_s == approx(0.01)  # the first sign of it still times detection


def test_an_in_process_restart_the_launcher_stopped_is_no_failed_restart():
    # Rank 1 is SIGKILLed; rank 0 begins an in-process restart, then the agent stops it (the
    # rescue grace) and restarts both: one round acted on the fault, and it brought it back.
    events = [
        *steps(0, 4, 0.0),  # [0, 5]
        ev(FAULT_INJECTED, 5.0, rank=1, fault="sigkill", step=4, index=0),
        ev(FAULT_DETECTED, 5.01, rank=-1, cause="sigkill", detector="exit", fault_rank=1),
        ev(RESTART_BEGIN, 5.02, rank=-1, layer="launcher", cause="sigkill", round=0),
        ev(RESTART_BEGIN, 5.03, rank=0, layer="inprocess", cause="exception"),
        ev(RESTART_END, 5.04, rank=0, layer="inprocess", status="stopped"),
        ev(RESTART_END, 5.3, rank=-1, attempt=1, layer="launcher", round=1),
        *steps(5, 9, 6.0, attempt=1),
    ]
    (fault,) = compute(events).faults
    assert fault.layer == "launcher" and fault.restarts == 1
    assert [g.failed_restarts for g in compute(events).by_class.values()] == [0]


def test_the_launchers_phases_before_the_first_step_are_startup():
    """The agent starts 2 s before its workers (interpreter, warm pool, rendezvous); its
    phases up to the first step are start-up, a later one (a restart's launch) is not."""
    workers = [
        phase("import", 2.0, 3.0),
        phase("pg_init", 3.0, 3.5),
        *steps(0, 4, 3.5),  # [3.5, 8.5]
    ]
    agent = [
        ev(PROCESS_START, 0.0, rank=-1),
        phase("import", 0.0, 1.2, rank=-1),
        phase("rendezvous", 1.2, 1.5, rank=-1),
        phase("launch", 1.5, 3.8, rank=-1),  # cut where the worker starts: 2.0
        phase("launch", 6.0, 6.5, rank=-1),  # mid-run: not start-up
    ]
    r = compute([*agent, *workers])
    check_partition(r)
    assert r.badput_s["startup"] == approx(2.0 + 1.0)  # [0, 2] agent, [2, 3] worker import
    assert r.badput_s["pg_init"] == approx(0.5)
    assert r.badput_s["other"] == approx(0.0)
    assert r.productive_s == approx(5.0)


def test_alert_records_change_no_figure() -> None:
    """A watcher's alert, even one written long after the job ended, is not part of the run."""
    from unbroken.ledger.events import ALERT, WATCHER_RANK

    base = [*steps(0, 4, 0.0), ev(JOB_END, 5.0, status="ok")]
    late = ev(ALERT, 500.0, rank=WATCHER_RANK, name="fault_recovered", key="k")
    early = ev(ALERT, -50.0, rank=WATCHER_RANK, name="fault_recovered", key="k2")
    assert compute([*base, late, early]).to_dict() == compute(base).to_dict()
    with pytest.raises(ValueError):
        compute([late])


def test_an_inprocess_restart_that_gives_up_is_the_launchers_fault():
    """A hang in native code: the watchdog detects it (layer inprocess) and the peer starts an
    in-process restart, but the hung rank never joins; the launcher restarts both."""
    events = [
        *steps(0, 1, 0.0),
        ev(FAULT_INJECTED, 2.0, rank=0, fault="hang-native", step=2),
        ev(FAULT_DETECTED, 2.5, rank=0, cause="timeout", detector="watchdog", layer="inprocess"),
        ev(RESTART_BEGIN, 2.6, rank=1, layer="inprocess"),
        ev(FAULT_DETECTED, 4.0, rank=-1, cause="exit", detector="exit_code", layer="launcher"),
        ev(RESTART_BEGIN, 4.1, rank=-1, layer="launcher"),
        ev(RESTART_END, 4.5, rank=-1, attempt=1, layer="launcher"),
        *steps(2, 2, 5.0, attempt=1),
    ]
    (f,) = compute(events).faults
    assert f.detector == "watchdog" and f.detection_s == approx(0.5)
    assert f.layer == "launcher"
    inprocess_only = [e for e in events if e.ts < 4.0 or e.kind == STEP]
    inprocess_only.append(ev(RESTART_END, 3.0, rank=1, layer="inprocess"))
    (g,) = compute(sorted(inprocess_only, key=lambda e: e.ts)).faults
    assert g.layer == "inprocess"
