"""Checkpoint storage failing, as the dashboard shows it: the snapshot's state and unprotected
time, the /metrics gauges, and the ``checkpoint_storage_failing`` alert, on hand-built ledgers
that agree with the report's ``storage``."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from timelines import rec, steps, write
from unbroken.dashboard import snapshot
from unbroken.dashboard.alerts import AlertConfig, evaluate
from unbroken.dashboard.index import EventIndex
from unbroken.dashboard.metrics import registry_for
from unbroken.dashboard.runs import RunSet
from unbroken.ledger import events as ev
from unbroken.ledger.goodput import compute

ENOSPC = "OSError: [Errno 28] No space left on device"


def _run(*, recovered: bool) -> list:
    """Steps 0..19 on two ranks over [0, 20]; step 4 committed at 5.5; the save of step 9 fails
    on both ranks at 10.5, step 14's is held back; with ``recovered``, step 17 commits at 18.5."""
    events = [
        *steps(0, 19, 0.0),
        rec(ev.CKPT_STAGE, 5.1, dur_s=0.1, step=4, staging_bytes=10, bytes=9),
        rec(ev.CKPT_COMMIT, 5.5, step=4),
        rec(ev.CKPT_STAGE, 10.1, dur_s=0.1, step=9, staging_bytes=10, bytes=9),
        rec(ev.CKPT_FAIL, 10.5, step=9, error=ENOSPC),
        rec(ev.CKPT_FAIL, 10.6, rank=1, step=9, error=ENOSPC),
        rec(ev.CKPT_SKIP, 15.1, step=14, reason="storage failing: retrying in 8 s"),
    ]
    if recovered:
        events.append(rec(ev.CKPT_COMMIT, 18.5, step=17))
    return events


def _snapshot(events, now: float) -> dict:
    index = EventIndex(events)
    return snapshot.build(index, compute(events), name="r", now=now, alerts=[], ledger={})


def test_the_snapshot_says_storage_is_failing_now_and_for_how_long() -> None:
    ck = _snapshot(_run(recovered=False), now=21.0)["checkpoint"]
    assert ck["storage_failing"] is True and ck["storage_failing_since"] == 10.5
    assert ck["unprotected_s"] == pytest.approx(20.0 - 10.5)  # to the ledger's newest record
    assert ck["failed_saves"] == 1 and ck["saves_held_back"] == 1
    assert ck["last_error"] == ENOSPC and ck["last_commit_step"] == 4

    ck = _snapshot(_run(recovered=True), now=21.0)["checkpoint"]
    assert ck["storage_failing"] is False and ck["storage_failing_since"] is None
    assert ck["unprotected_s"] == pytest.approx(18.5 - 10.5)
    assert ck["last_commit_step"] == 17

    ck = _snapshot([*steps(0, 9, 0.0), rec(ev.CKPT_COMMIT, 5.5, step=4)], now=11.0)["checkpoint"]
    assert ck["storage_failing"] is False and ck["unprotected_s"] == 0.0
    assert ck["failed_saves"] == 0 and ck["last_error"] is None


def test_a_run_whose_every_save_failed_still_shows_its_checkpoints() -> None:
    events = [*steps(0, 9, 0.0), rec(ev.CKPT_FAIL, 5.5, step=4, error=ENOSPC)]
    ck = _snapshot(events, now=11.0)["checkpoint"]
    assert ck["enabled"] and ck["storage_failing"] and ck["last_commit_step"] is None


def _scrape(tmp_path: Path, events) -> dict[str, float]:
    write(tmp_path, events)
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        text = generate_latest(registry_for(runs, refresh=True)).decode()
    finally:
        runs.close()
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def test_metrics_export_the_state_and_the_unprotected_time(tmp_path: Path) -> None:
    m = _scrape(tmp_path / "failing", _run(recovered=False))
    assert m["unbroken_checkpoint_storage_failing"] == 1.0
    assert m["unbroken_checkpoint_unprotected_seconds"] == pytest.approx(9.5)
    assert m["unbroken_checkpoint_saves_failed_total"] == 1.0
    m = _scrape(tmp_path / "recovered", _run(recovered=True))
    assert m["unbroken_checkpoint_storage_failing"] == 0.0
    assert m["unbroken_checkpoint_unprotected_seconds"] == pytest.approx(8.0)
    m = _scrape(tmp_path / "clean", [*steps(0, 9, 0.0), rec(ev.CKPT_COMMIT, 5.5, step=4)])
    assert m["unbroken_checkpoint_storage_failing"] == 0.0
    assert m["unbroken_checkpoint_unprotected_seconds"] == 0.0
    assert m["unbroken_checkpoint_saves_failed_total"] == 0.0


def _storage_alerts(events, now: float = 21.0):
    alerts = evaluate(events, compute(events), now=now, cfg=AlertConfig())
    return [a for a in alerts if a.name == "checkpoint_storage_failing"]


def test_the_alert_holds_while_storage_fails_once_per_interval() -> None:
    (a,) = _storage_alerts(_run(recovered=False))
    assert a.severity == "warning" and a.ts == 10.5
    assert a.key == "checkpoint_storage_failing:10.500"
    assert a.value == pytest.approx(9.5) and a.labels == {"error": "OSError"}
    assert "1 save failed" in a.summary and ENOSPC in a.summary
    assert "memory tier" in a.summary and "since the newest commit (step 4)" in a.summary
    # Later evaluations of the same interval keep its key: recorded once.
    later = [*_run(recovered=False), *steps(20, 24, 20.0)]
    assert [x.key for x in _storage_alerts(later, now=26.0)] == [a.key]
    # A commit ends it; a new failure is a new interval, a new key.
    assert _storage_alerts(_run(recovered=True)) == []
    again = [*_run(recovered=True), rec(ev.CKPT_FAIL, 19.5, step=18, error=ENOSPC)]
    assert [x.key for x in _storage_alerts(again)] == ["checkpoint_storage_failing:19.500"]
