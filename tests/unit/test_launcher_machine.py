"""The agent state machine, driven by scripted observations."""

from __future__ import annotations

import signal

import pytest

from unbroken.launcher import errors
from unbroken.launcher.errors import Failure
from unbroken.launcher.machine import Machine, State, StopReason, Tick

S = State


def failure(rank: int = 1, ts: float = 1.0) -> Failure:
    return Failure(
        rank=rank, local_rank=rank, cause="sigkill", category="infra", detector="exit", ts=ts
    )


def to_running(m: Machine) -> None:
    if m.state is S.INIT:
        m.begin()
    m.rendezvous_done()
    m.started()


def test_clean_run() -> None:
    m = Machine(max_restarts=0, max_no_progress_restarts=3)
    to_running(m)
    assert m.observe(Tick()) is S.RUNNING
    assert m.observe(Tick(succeeded=True)) is S.SUCCEEDED
    assert m.history == [S.INIT, S.RENDEZVOUS, S.STARTING, S.RUNNING, S.SUCCEEDED]
    assert m.exit_code == errors.EXIT_OK and m.terminal


def test_failures_restart_until_the_budget_is_spent() -> None:
    m = Machine(max_restarts=2, max_no_progress_restarts=0)
    for expected in (S.RENDEZVOUS, S.RENDEZVOUS, S.FAILED):
        to_running(m)
        assert m.observe(Tick(failures=(failure(),))) is S.STOPPING
        assert m.stop_reason is StopReason.FAILURE
        assert m.stopped(progress=None) is expected
    assert m.restarts == 2 and m.exit_code == errors.EXIT_BUDGET_EXHAUSTED
    assert m.failures == [failure()]  # the last round's


def test_failure_wins_over_success_and_membership_in_one_tick() -> None:
    m = Machine(max_restarts=1, max_no_progress_restarts=0)
    to_running(m)
    m.observe(Tick(failures=(failure(),), succeeded=True, nodes_waiting=1))
    assert m.stop_reason is StopReason.FAILURE


def test_membership_changes_do_not_use_the_budget() -> None:
    m = Machine(max_restarts=0, max_no_progress_restarts=1)
    for _ in range(5):
        to_running(m)
        assert m.observe(Tick(nodes_waiting=2)) is S.STOPPING
        assert m.stopped(progress=None) is S.RENDEZVOUS
    assert m.restarts == 0


def test_no_progress_guard_counts_restarts_without_a_new_step() -> None:
    m = Machine(max_restarts=10, max_no_progress_restarts=2)
    outcomes = []
    for progress in (5, 9, 9, 9):
        to_running(m)
        m.observe(Tick(failures=(failure(),)))
        outcomes.append(m.stopped(progress=progress))
    assert outcomes == [S.RENDEZVOUS, S.RENDEZVOUS, S.RENDEZVOUS, S.FAILED]
    assert m.exit_code == errors.EXIT_NO_PROGRESS and m.restarts == 3


def test_a_job_that_reports_no_step_is_never_stopped_for_it() -> None:
    m = Machine(max_restarts=5, max_no_progress_restarts=1)
    for _ in range(5):
        to_running(m)
        m.observe(Tick(failures=(failure(),)))
        assert m.stopped(progress=None) is S.RENDEZVOUS
    to_running(m)
    m.observe(Tick(failures=(failure(),)))
    assert m.stopped(progress=None) is S.FAILED
    assert m.exit_code == errors.EXIT_BUDGET_EXHAUSTED


def test_signals_stop_and_fail_with_128_plus_the_signal() -> None:
    m = Machine(max_restarts=5, max_no_progress_restarts=0)
    to_running(m)
    assert m.observe(Tick(signal=signal.SIGTERM, failures=(failure(),))) is S.STOPPING
    assert m.stopped(progress=None) is S.FAILED
    assert m.exit_code == 128 + signal.SIGTERM
    m = Machine(max_restarts=5, max_no_progress_restarts=0)
    m.begin()
    assert m.interrupt(signal.SIGINT) is S.STOPPING
    assert m.stopped(progress=None) is S.FAILED and m.exit_code == 128 + signal.SIGINT


def test_rendezvous_and_start_failures() -> None:
    m = Machine(max_restarts=5, max_no_progress_restarts=0)
    m.begin()
    assert m.rendezvous_failed(failure(-1)) is S.FAILED
    assert m.exit_code == errors.EXIT_RENDEZVOUS_FAILED
    m = Machine(max_restarts=1, max_no_progress_restarts=0)
    m.begin()
    m.rendezvous_done()
    assert m.start_failed(failure(-1)) is S.STOPPING
    assert m.stopped(progress=None) is S.RENDEZVOUS and m.restarts == 1


def test_illegal_transitions_are_bugs() -> None:
    m = Machine(max_restarts=0, max_no_progress_restarts=0)
    with pytest.raises(AssertionError):
        m.started()
    with pytest.raises(AssertionError):
        m.observe(Tick())
    with pytest.raises(ValueError):
        Machine(max_restarts=-1, max_no_progress_restarts=0)
