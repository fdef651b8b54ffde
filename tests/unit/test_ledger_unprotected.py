"""The time a run went unprotected by durable checkpoints, on hand-built timelines, and how the
text, JSON and HTML reports show it; every expected number is derived from the timeline."""

from __future__ import annotations

import json
import random

import pytest

from unbroken.ledger.events import CKPT_COMMIT, CKPT_FAIL, CKPT_SKIP, JOB_END, STEP, Event
from unbroken.ledger.goodput import compute
from unbroken.ledger.html import RunView, render
from unbroken.ledger.report import format_table, storage_line, to_json
from unbroken.ledger.unprotected import StorageFailures, storage_failures

ENOSPC = "OSError: [Errno 28] No space left on device"
EROFS = "OSError: [Errno 30] Read-only file system"


def ev(kind: str, ts: float, *, rank: int = 0, attempt: int = 0, **data) -> Event:
    return Event(kind=kind, ts=ts, run="r", rank=rank, attempt=attempt, data=data)


def run(*extra: Event, end: float = 20.5) -> list[Event]:
    """Steps 0..19 on ranks 0 and 1 over [0, 20] (step n ends at n + 1), a commit of step 4 at
    5.5, the job's end at ``end``, and ``extra``."""
    events = [ev(STEP, n + 1.0, rank=r, dur_s=1.0, step=n) for n in range(20) for r in (0, 1)]
    events += [ev(CKPT_COMMIT, 5.5, step=4), ev(JOB_END, end, rank=-1, status="ok"), *extra]
    return events


def fail(ts: float, step: int | None, *, rank: int = 0, error: str = ENOSPC, **kw) -> Event:
    return ev(CKPT_FAIL, ts, rank=rank, step=step, error=error, **kw)


def test_no_failure_is_no_unprotected_time_and_no_report_line() -> None:
    events = run(ev(CKPT_COMMIT, 10.5, step=9))
    report = compute(events)
    assert report.storage == StorageFailures()
    assert not report.storage.failing and report.storage.unprotected_s == 0.0
    assert storage_line(report.storage) is None
    assert "checkpoint storage" not in format_table(report)
    assert "storage-failing" not in render([RunView("clean", report, events)])
    assert json.loads(to_json(report))["storage"] == {
        "failed_saves": 0,
        "saves_held_back": 0,
        "unprotected_s": 0.0,
        "intervals": [],
        "failing_since": None,
        "failing": False,
        "last_error": None,
    }


def test_failure_then_a_commit_ends_the_interval() -> None:
    events = run(
        fail(8.5, 7),
        ev(CKPT_SKIP, 10.5, step=9, reason="storage failing: retrying in 4 s"),
        ev(CKPT_SKIP, 11.0, step=10, reason="busy: step 7 still persisting"),  # not held back
        fail(12.5, 11, error=EROFS),
        ev(CKPT_COMMIT, 15.5, step=14),
    )
    s = compute(events).storage
    assert s.intervals == [(8.5, 15.5)]  # from the first failure after step 4's commit
    assert s.unprotected_s == pytest.approx(7.0)
    assert s.failed_saves == 2 and s.saves_held_back == 1
    assert s.failing_since is None and not s.failing
    assert s.last_error == EROFS


def test_failure_until_the_end_runs_to_the_last_record() -> None:
    s = compute(run(fail(12.5, 11), end=20.5)).storage
    assert s.intervals == [(12.5, 20.5)]  # the job's end
    assert s.unprotected_s == pytest.approx(8.0)
    assert s.failing and s.failing_since == 12.5
    # A run still going: its newest record ends the interval.
    alive = [e for e in run(fail(12.5, 11)) if e.kind != JOB_END]
    assert compute(alive).storage.intervals == [(12.5, 20.0)]
    # t1 given: the run's end as the report has it.
    assert storage_failures(alive, t1=30.0).intervals == [(12.5, 30.0)]


def test_failures_on_two_ranks_overlap_into_one_interval() -> None:
    events = run(
        fail(8.5, 7, rank=0),
        fail(8.7, 7, rank=1),  # the same save, failing on another rank
        fail(10.2, 9, rank=1, error=EROFS),
        ev(CKPT_COMMIT, 15.5, step=14),
        fail(16.5, 15, rank=1),  # a second episode after the commit
        ev(CKPT_COMMIT, 18.5, step=17),
    )
    s = compute(events).storage
    assert s.intervals == [(8.5, 15.5), (16.5, 18.5)]
    assert s.unprotected_s == pytest.approx(7.0 + 2.0)
    assert s.failed_saves == 3  # steps 7 (counted once), 9 and 15
    assert not s.failing and s.last_error == ENOSPC


def test_failure_before_any_commit() -> None:
    events = [e for e in run(ev(CKPT_COMMIT, 9.5, step=8)) if e.ts != 5.5]  # no commit at 5.5
    s = compute([*events, fail(3.5, 2)]).storage
    assert s.intervals == [(3.5, 9.5)]  # begins at the failure, not at the run's start
    assert s.unprotected_s == pytest.approx(6.0) and s.failed_saves == 1


def test_rejected_at_restore_is_no_failed_save() -> None:
    rejected = fail(2.0, 0, error="rejected at restore: checksum mismatch", phase="load")
    assert compute(run(rejected)).storage == StorageFailures()


def test_a_commit_at_the_same_time_as_a_failure_ends_it() -> None:
    s = compute(run(fail(8.5, 7), ev(CKPT_COMMIT, 8.5, step=6))).storage
    assert s.intervals == [(8.5, 8.5)] and s.unprotected_s == 0.0
    assert s.failed_saves == 1 and not s.failing  # the failure is not newer than the commit


def test_saves_are_told_apart_by_attempt_and_steps_without_a_number_count_alone() -> None:
    events = run(
        fail(8.5, 7),
        fail(9.0, 7, attempt=1),  # the same step saved again by a restarted job
        fail(9.2, None, rank=0, error="the checkpoint writer died"),
        fail(9.3, None, rank=1, error="the checkpoint writer died"),
    )
    s = compute(events).storage
    assert s.failed_saves == 4 and s.intervals == [(8.5, 20.5)]
    assert s.last_error == "the checkpoint writer died"


def test_order_does_not_matter() -> None:
    events = run(fail(8.5, 7), fail(10.2, 9, rank=1), ev(CKPT_COMMIT, 15.5, step=14))
    want = compute(events).storage
    shuffled = list(events)
    random.Random(3).shuffle(shuffled)
    assert compute(shuffled).storage == want == storage_failures(shuffled)


def test_the_reports_show_one_line() -> None:
    long_error = ENOSPC + " " + "x" * 300 + "\nTraceback (most recent call last): ..."
    events = run(
        fail(8.5, 7),
        ev(CKPT_SKIP, 10.5, step=9, reason="storage failing: retrying in 4 s"),
        fail(12.5, 11, error=long_error),
    )
    report = compute(events)
    line = storage_line(report.storage)
    assert line is not None
    assert line.startswith(
        "checkpoint storage failing: 2 saves failed, 1 held back, unprotected for 12.0 s, "
        "still at the end (last error: OSError: [Errno 28] No space left on device xxx"
    )
    assert "Traceback" not in line and line.endswith("…)")
    text = format_table(report)
    assert text.count("checkpoint storage failing") == 1
    assert text.index("checkpoint storage failing") < text.index("badput")
    d = json.loads(to_json(report))
    assert d["storage"]["unprotected_s"] == 12.0 and d["storage"]["failing"]
    assert d["storage"]["intervals"] == [[8.5, 20.5]] and d["storage"]["last_error"] == long_error
    assert d == report.to_dict()
    page = render([RunView("full-disk", report, events)])
    assert page.count("class='warn storage-failing'") == 1
    assert "full-disk: checkpoint storage failing: 2 saves failed" in page
    recovered = compute([*events, ev(CKPT_COMMIT, 15.5, step=14)])
    assert storage_line(recovered.storage) == (
        "checkpoint storage failing: 2 saves failed, 1 held back, unprotected for 7.0 s "
        f"(last error: {long_error.splitlines()[0][:199]}…)"
    )
