"""Calibrated hang timeouts: the math of ``Calibrator`` and the watchdog that feeds it, on a
fake clock (warm-up, window maximum, floor, hysteresis, persistence, explicit values)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sinks import Sink
from unbroken.ledger import events as ev
from unbroken.restart import RestartConfig
from unbroken.restart.calibrate import WINDOW, Calibrator, state_path
from unbroken.restart.watchdog import NONE, RESTART, Watchdog

DEFAULT = RestartConfig()


def tuned(sink: Sink) -> list[dict]:
    return [d for k, d in sink.events if k == ev.TUNED]


def test_warm_up_then_the_floor_for_fast_steps() -> None:
    c = Calibrator(DEFAULT)
    for _ in range(DEFAULT.timeout_warmup - 1):
        c.gap(0.07)
        assert c.timeouts(initial=False) == (60.0, 90.0)  # the ceilings until warmed up
    c.gap(0.07)
    soft, hard = c.timeouts(initial=False)
    assert soft == DEFAULT.timeout_floor_s == 1.0  # 8 x 70 ms is under the floor
    assert hard == pytest.approx(11.0)  # max(1.5 x soft, soft + 10 s)


def test_slow_steps_get_factor_times_the_largest_recent_gap() -> None:
    c = Calibrator(DEFAULT)
    for i in range(100):
        c.gap(0.5 if i != 50 else 0.9)  # one slow step among them sizes the timeout
    soft, hard = c.timeouts(initial=False)
    assert soft == pytest.approx(8 * 0.9)
    assert hard == pytest.approx(8 * 0.9 + 10.0)  # max(1.5 x soft, soft + 10 s)
    # 3-5x slower steps than the slowest seen still do not reach the timeout.
    assert soft > 5 * 0.9


def test_the_window_forgets_an_old_slow_gap() -> None:
    c = Calibrator(DEFAULT)
    c.gap(2.0)
    for _ in range(WINDOW):
        c.gap(0.5)
    assert c.gaps.max == pytest.approx(0.5)
    assert c.timeouts(initial=False)[0] == pytest.approx(4.0)


def test_hysteresis_and_a_ledger_record_per_change() -> None:
    sink = Sink()
    c = Calibrator(DEFAULT, ledger=sink)
    for _ in range(30):
        c.gap(0.5)
    c.gap(0.52)  # 4 % more: within the hysteresis, no move
    assert [(d["name"], d["value"], d["previous"]) for d in tuned(sink)] == [
        ("soft_timeout_s", 4.0, None)
    ]
    c.gap(1.0)  # a slower step: the timeout grows at once
    assert [(d["value"], d["previous"]) for d in tuned(sink)][1:] == [(8.0, 4.0)]
    assert tuned(sink)[1]["hard_s"] == pytest.approx(18.0)


def test_the_initial_phase_uses_its_own_observed_durations() -> None:
    c = Calibrator(DEFAULT)
    assert c.timeouts(initial=True) == (600.0, 900.0)  # nothing seen yet
    c.first_step(2.0)
    assert c.timeouts(initial=True) == (60.0, 90.0)  # 8 x 2 s is under the 60 s floor
    c.first_step(12.0)  # e.g. a restore from disk after a restart
    assert c.timeouts(initial=True) == (pytest.approx(96.0), pytest.approx(144.0))


def test_calibration_persists_across_a_process_restart(tmp_path: Path) -> None:
    path = state_path(tmp_path, 3)
    first = Calibrator(DEFAULT, path=path)
    first.first_step(1.0)
    for _ in range(40):
        first.gap(0.2)
    assert path.is_file()
    sink = Sink()
    again = Calibrator(DEFAULT, ledger=sink, path=path)
    assert again.timeouts(initial=False) == first.timeouts(initial=False) == (1.6, 11.6)
    assert again.timeouts(initial=True)[0] == 60.0
    assert {d["name"] for d in tuned(sink)} == {"soft_timeout_s", "initial_soft_timeout_s"}
    assert all(d.get("restored") for d in tuned(sink))
    again.gap(0.21)  # no second warm-up
    assert again.timeouts(initial=False)[0] == pytest.approx(1.6)
    path.write_text("{not json")
    assert Calibrator(DEFAULT, path=path).timeouts(initial=False) == (60.0, 90.0)


def test_explicit_timeouts_win() -> None:
    sink = Sink()
    cfg = RestartConfig(soft_timeout_s=30.0, initial_soft_timeout_s=100.0)
    c = Calibrator(cfg, ledger=sink)
    for _ in range(100):
        c.gap(0.05)
    c.first_step(1.0)
    assert c.timeouts(initial=False) == (30.0, 45.0)
    assert c.timeouts(initial=True) == (100.0, 150.0)
    assert tuned(sink) == []
    # An explicit hard timeout caps a calibrated soft one's ceiling and stays as given.
    c = Calibrator(RestartConfig(hard_timeout_s=3.0))
    for _ in range(30):
        c.gap(0.3)
    assert c.timeouts(initial=False) == (2.0, 3.0)


def test_watchdog_on_a_fake_clock_catches_a_hang_of_a_70ms_job_in_about_a_second() -> None:
    w = Watchdog(DEFAULT)
    w.arm(0.0)
    t = 3.0
    w.progress(t, step=True)  # the first step: 3 s after the start (initial phase)
    for _ in range(200):
        t += 0.07
        w.progress(t, step=True)
    # A region without hang protection (a save) is no gap; nor the time before it ends.
    w.protect(t + 0.01, enter=True)
    w.protect(t + 30.0, enter=False)
    t += 30.0
    assert w.calibrator.gaps.max == pytest.approx(0.07)
    assert w.calibrator.first_step_max_s == 3.0
    assert w.evaluate(t + 0.99, silent_s=0.0).action == NONE
    assert w.evaluate(t + 1.01, silent_s=0.0).action == RESTART


def test_gaps_after_a_restart_request_do_not_count() -> None:
    w = Watchdog(DEFAULT)
    w.arm(0.0)
    w.progress(1.0, step=True)
    w.requested(1.5)
    w.progress(9.0, step=True)
    assert w.calibrator.samples == 0


def test_a_protected_save_before_each_step_done_leaves_the_step_time_as_the_gap() -> None:
    """The reference script snapshots each step inside ``no_hang_protection`` right before
    ``step_done``: the calibrated gap is the step's own time, not the few ms after the save."""
    w = Watchdog(DEFAULT)
    w.arm(0.0)
    t = 1.0
    w.progress(t, step=True)
    for _ in range(50):
        t += 0.5  # forward, backward, optimizer
        w.protect(t, enter=True)
        t += 0.2  # the snapshot
        w.protect(t, enter=False)
        t += 0.001
        w.progress(t, step=True)
    assert w.calibrator.gaps.max == pytest.approx(0.501)
    soft, _ = w.calibrator.timeouts(initial=False)
    assert soft == pytest.approx(8 * 0.501)
