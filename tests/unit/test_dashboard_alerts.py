"""Alert rules on hand-built ledgers: a fault that recovered once vs one that keeps coming back,
and each of the other rules, with the thresholds they are configured with."""

from __future__ import annotations

from pathlib import Path

import pytest

from timelines import fault, faulty_run, rec, steps
from unbroken.dashboard.alerts import AlertConfig, evaluate
from unbroken.ledger import events as ev
from unbroken.ledger.goodput import compute


def _alerts(events, *, now: float = 41.0, **cfg):
    return evaluate(events, compute(events), now=now, cfg=AlertConfig(**cfg))


def _names(alerts) -> list[str]:
    return [a.name for a in alerts]


def test_one_recovered_fault_is_info_and_nothing_pages() -> None:
    alerts = _alerts(faulty_run(faults_at=(10.0,)))
    assert _names(alerts) == ["fault_recovered"]
    (a,) = alerts
    assert a.severity == "info" and a.labels == {"rank": "1", "cause": "exception"}
    assert "4 steps lost" in a.summary  # steps 5..8 rolled back


def test_three_faults_on_one_rank_page_once_per_cluster() -> None:
    alerts = _alerts(faulty_run(faults_at=(10.0, 20.0, 30.0)))
    pages = [a for a in alerts if a.severity == "page"]
    # Same rank, same cause and same restore point: one page per dimension, each once.
    assert sorted(a.key.split(":")[1] for a in pages) == [
        "cause=exception",
        "rank=1",
        "restore_step=5",
    ]
    assert all(a.name == "fault_recurring" and a.value == 3.0 for a in pages)
    assert _names(alerts).count("fault_recovered") == 3
    # Evaluated again later with more of the same, the keys stay: a caller records nothing new.
    again = _alerts(faulty_run(faults_at=(10.0, 20.0, 30.0, 35.0)))
    assert {a.key for a in pages} <= {a.key for a in again}


def test_recurrence_needs_the_faults_within_the_window() -> None:
    events = faulty_run(faults_at=(10.0, 20.0, 30.0))
    # Three faults 10 s apart span 20 s.
    assert "fault_recurring" not in _names(_alerts(events, recurring_window_s=19.0))
    assert "fault_recurring" in _names(_alerts(events, recurring_window_s=20.0))
    assert "fault_recurring" not in _names(_alerts(events, recurring_count=4))


def test_faults_on_different_ranks_and_restore_points_do_not_recur() -> None:
    events = faulty_run(faults_at=(10.0,), rank=0, restored=3)
    events += fault(20.5, rank=1, kind="sigkill", layer="launcher", restored=4)
    events += fault(30.5, rank=0, kind="hang", restored=6)
    assert "fault_recurring" not in _names(_alerts(events))


def test_no_progress_across_restarts() -> None:
    events = steps(0, 9, 0.0)  # highest step 9 at t=10
    for t in (11.0, 14.0, 17.0):
        events += fault(t, restored=9)
        events += steps(9, 9, t + 1)  # back to step 9, never past it
    alerts = _alerts(events, now=21.0)
    (a,) = [a for a in alerts if a.name == "no_progress"]
    assert a.severity == "page" and a.key == "no_progress:9" and a.value == 3.0


def test_restart_budget_nearly_spent() -> None:
    events = faulty_run(faults_at=(10.0,))
    launcher = [
        rec(
            ev.RESTART_BEGIN,
            10.0 + i,
            rank=ev.LAUNCHER_RANK,
            attempt=i,
            round=i,
            layer="launcher",
            cause="sigkill",
        )
        for i in range(3)
    ]
    assert "restart_budget" not in _names(_alerts(events + launcher[:3]))  # 3 of 4
    alerts = _alerts(events + launcher[:3], budget_ratio=0.75)
    (a,) = [a for a in alerts if a.name == "restart_budget"]
    assert a.value == 0.75 and "3 of 4" in a.summary


def test_no_committed_checkpoint_for_too_long() -> None:
    events = [*steps(0, 29, 0.0), rec(ev.CKPT_STAGE, 5.0, dur_s=0.1, step=4)]
    events.append(rec(ev.CKPT_COMMIT, 5.5, step=4))
    assert "no_checkpoint" not in _names(_alerts(events, now=30.0, max_commit_age_s=30.0))
    alerts = _alerts(events, now=30.0, max_commit_age_s=20.0)
    (a,) = [a for a in alerts if a.name == "no_checkpoint"]
    assert a.key == "no_checkpoint:4" and a.value == pytest.approx(24.5)
    # A job that does not checkpoint at all has nothing to miss.
    assert "no_checkpoint" not in _names(_alerts(steps(0, 29, 0.0), now=100.0, max_commit_age_s=1))


def test_skipped_saves_in_a_row() -> None:
    events = steps(0, 29, 0.0)
    for s in (4, 9, 14):
        events.append(rec(ev.CKPT_SKIP, s + 1.0, step=s, reason="busy: step 0 still persisting"))
    events.append(rec(ev.CKPT_COMMIT, 3.0, step=0))
    (a,) = [a for a in _alerts(events) if a.name == "ckpt_skipped"]
    assert a.key == "ckpt_skipped:4" and a.value == 3.0 and a.labels == {"reason": "busy"}
    events.append(rec(ev.CKPT_COMMIT, 12.0, step=9))  # a commit between breaks the run of skips
    assert "ckpt_skipped" not in _names(_alerts(events))


def test_low_goodput_over_a_window() -> None:
    events = faulty_run(faults_at=(10.0, 20.0, 30.0))
    report = compute(events)
    assert report.training_goodput < 0.6
    low = [
        a
        for a in _alerts(events, goodput_window_s=20.0, min_goodput=0.9)
        if a.name == "low_goodput"
    ]
    assert len(low) == 1 and low[0].value < 0.9
    assert "low_goodput" not in _names(_alerts(events, goodput_window_s=20.0, min_goodput=0.1))
    # A run shorter than the window is not judged yet.
    assert "low_goodput" not in _names(_alerts(events, goodput_window_s=100.0, min_goodput=0.9))


def test_config_refuses_bad_values_and_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="recurring_count must be >= 1"):
        AlertConfig(recurring_count=0)
    with pytest.raises(ValueError, match="min_goodput must be a ratio"):
        AlertConfig(min_goodput=1.5)
    bad = tmp_path / "a.yaml"
    bad.write_text("recurring_cont: 2\n")
    with pytest.raises(ValueError, match="unknown alert settings.*recurring_cont"):
        AlertConfig.from_yaml(bad)
    bad.write_text("recurring_count: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        AlertConfig.from_yaml(bad)
    good = tmp_path / "b.yaml"
    good.write_text("recurring_count: 2\nrecurring_window_s: 60\n")
    assert AlertConfig.from_yaml(good).recurring_count == 2
    with pytest.raises(FileNotFoundError):
        AlertConfig.from_yaml(tmp_path / "missing.yaml")


def test_dashboard_help_names_every_threshold() -> None:
    import argparse
    import dataclasses

    from unbroken.dashboard import app

    p = argparse.ArgumentParser()
    app.add_arguments(p)
    text = "".join(p.format_help().split())
    assert all(f.name in text for f in dataclasses.fields(AlertConfig))
