"""A drain's outage as ``unbroken bench k8s`` reports it, on hand-built ledgers: one node
drained (the survivors restart) and every node drained (new pods start over); and the runs'
validation of what to lose."""

from __future__ import annotations

import pytest

from unbroken.bench.k8s import NodeLoss
from unbroken.bench.k8s_tail import drain_outage
from unbroken.ledger import events as ev


def _steps(ranks: int, ts: float) -> list[ev.Event]:
    return [ev.Event(kind=ev.STEP, ts=ts + r / 10, rank=r, data={"step": 9}) for r in range(ranks)]


def _saves(ranks: int, ts: float) -> list[ev.Event]:
    return [
        ev.Event(kind=ev.PHASE, ts=ts + r / 100, rank=r, data={"name": "preemption"})
        for r in range(ranks)
    ]


def test_one_node_drained_counts_from_the_last_save_to_every_rank_training_after_the_restart():
    events = [
        *_steps(4, 99.0),  # before: not counted
        *_saves(4, 101.0),  # ends at 101.03
        ev.Event(kind=ev.RESTART_END, ts=102.0, rank=ev.LAUNCHER_RANK),
        *_steps(4, 103.0),  # the last rank's first step at 103.3
    ]
    assert drain_outage(events, since=100.0) == pytest.approx(103.3 - 101.03)


def test_every_node_drained_counts_to_the_new_pods_first_steps():
    # No agent survived to restart: the next round is the new pods', with no restart record.
    events = [*_saves(4, 101.0), *_steps(4, 106.0)]
    assert drain_outage(events, since=100.0) == pytest.approx(106.3 - 101.03)
    assert drain_outage(_saves(4, 101.0), since=100.0) is None  # nobody trained again
    assert drain_outage(_steps(4, 106.0), since=100.0) is None  # nothing was saved


def test_what_to_lose_is_checked():
    assert NodeLoss(lose="all", drain=True).lose == "all"
    with pytest.raises(ValueError, match="index:N, group-rank:N or all"):
        NodeLoss(lose="everything")
    with pytest.raises(ValueError, match="not the baseline"):
        NodeLoss(lose="all", baseline=True)
