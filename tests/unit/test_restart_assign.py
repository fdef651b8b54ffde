"""Culprit, fault accounting and the next iteration's roster: pure logic."""

from __future__ import annotations

from unbroken.restart import RestartConfig
from unbroken.restart import assign as a


def rec(
    member: int, kind: str = a.OK, seq: int | None = None, point: int | None = 0
) -> a.ExitRecord:
    return a.ExitRecord(member=member, rank=member, kind=kind, seq=seq, restore_point=point)


CFG = RestartConfig()


def test_culprit_is_the_first_report_not_its_victims() -> None:
    records = [rec(0, a.EXCEPTION, seq=2), rec(1, a.EXCEPTION, seq=1), rec(2, a.PEER)]
    assert a.find_culprit(records).member == 1
    assert a.find_culprit([rec(0), rec(1)]) is None


def test_a_rank_stuck_in_a_collective_yields_to_the_rank_that_hangs_in_python() -> None:
    records = [rec(0, a.STUCK, seq=1), rec(1, a.HANG, seq=2)]
    assert a.find_culprit(records).member == 1
    assert a.find_culprit([rec(0, a.STUCK, seq=1), rec(1, a.STUCK, seq=2)]).member == 0


def test_without_any_published_report_the_lowest_failing_member_is_blamed() -> None:
    assert a.find_culprit([rec(3, a.PG_INIT), rec(1, a.PG_INIT), rec(0)]).member == 1


def test_account_counts_faults_per_member_and_per_restore_point() -> None:
    h = a.History()
    h = a.account(h, rec(1, a.EXCEPTION, 1), [rec(0, point=0), rec(1, a.EXCEPTION, 1, point=0)])
    assert (h.faults_of(1), h.restore_point, h.restore_point_faults) == (1, 0, 1)
    # Failing again before any step: the same restore point.
    h = a.account(h, rec(0, a.HANG, 1), [rec(0, a.HANG, 1, point=None), rec(1, point=None)])
    assert (h.faults_of(0), h.restore_point, h.restore_point_faults) == (1, 0, 2)
    # A later restore point (a newer checkpoint) starts a new count.
    h = a.account(h, rec(0, a.HANG, 1), [rec(0, a.HANG, 1, point=40), rec(1, point=40)])
    assert (h.faults_of(0), h.restore_point, h.restore_point_faults) == (2, 40, 1)


def decide(records, healthy=None, members=(0, 1, 2), history=None, config=CFG, iteration=0):
    healthy = {r.member: True for r in records} if healthy is None else healthy
    return a.decide(
        iteration=iteration,
        members=members,
        records=records,
        healthy=healthy,
        history=history or a.History(),
        config=config,
    )


def test_all_ok_returns() -> None:
    d = decide([rec(0), rec(1), rec(2)])
    assert d.status == a.STATUS_OK and d.members == (0, 1, 2) and d.culprit is None


def test_a_fault_restarts_everyone_healthy_in_rank_order() -> None:
    d = decide([rec(0, a.PEER), rec(1, a.EXCEPTION, 1), rec(2, a.PEER)])
    assert d.status == a.STATUS_RESTART and d.members == (0, 1, 2)
    assert d.culprit.member == 1 and d.history.faults_of(1) == 1


def test_unhealthy_and_absent_ranks_leave_and_the_rest_renumber() -> None:
    records = [rec(0, a.PEER), rec(1, a.EXCEPTION, 1)]
    d = decide(records, healthy={0: True, 1: False})
    assert d.status == a.STATUS_RESTART and d.members == (0,)
    assert set(d.excluded) == {"1", "2"}
    assert "health" in d.excluded["1"] and "barrier" in d.excluded["2"]


def test_escalation_limits() -> None:
    fault = [rec(0, a.PEER), rec(1, a.EXCEPTION, 1), rec(2, a.PEER)]
    d = decide(fault, config=RestartConfig(max_iterations=2), iteration=1)
    assert d.status == a.STATUS_ESCALATE and "max_iterations" in d.reason
    history = a.History(member_faults={"1": 2})
    d = decide(fault, config=RestartConfig(max_rank_faults=3), history=history)
    assert d.status == a.STATUS_ESCALATE and "rank 1 caused 3 faults" in d.reason
    history = a.History(restore_point=0, restore_point_faults=2)
    d = decide(fault, config=RestartConfig(max_restore_point_faults=3), history=history)
    assert d.status == a.STATUS_ESCALATE and "restore point 0" in d.reason
    d = decide(fault, healthy={0: True, 1: False, 2: False}, config=RestartConfig(min_world_size=2))
    assert d.status == a.STATUS_ESCALATE and "min_world_size=2" in d.reason


def test_decisions_and_records_survive_the_json_round_trip() -> None:
    d = decide([rec(0, a.PEER), rec(1, a.EXCEPTION, 1)], healthy={0: True, 1: False})
    assert a.Decision.from_json(d.to_json()) == d
    r = rec(2, a.HANG, 3, point=7)
    assert a.ExitRecord.from_json(r.to_json()) == r
