"""The adaptive durable interval: Young/Daly, its bounds, agreement and persistence."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from sinks import Sink
from unbroken.checkpoint.schedule.interval import (
    AdaptiveInterval,
    IntervalConfig,
    interval_steps,
    young_daly_s,
)
from unbroken.ledger import events as ev

CFG = IntervalConfig(initial_steps=10, min_steps=2, max_steps=200, mtbf_prior_s=3600.0)


def same(values: Sequence[float]) -> Sequence[float]:
    return values  # one rank


def test_young_daly_and_its_bounds() -> None:
    assert young_daly_s(0.5, 3600.0) == pytest.approx(60.0)  # sqrt(2 x 0.5 x 3600)
    # 60 s at 0.1 s per step: 600 steps, capped at max_steps.
    assert interval_steps(cost_s=0.5, persist_s=1.0, step_s=0.1, mtbf_s=3600.0, config=CFG) == 200
    # A cheap checkpoint and frequent failures: sqrt(2 x 0.001 x 10) = 0.14 s = 2 steps; the min.
    assert interval_steps(cost_s=0.001, persist_s=0.0, step_s=0.1, mtbf_s=10.0, config=CFG) == 2
    tiny = IntervalConfig(initial_steps=1, min_steps=1, max_steps=200)
    assert interval_steps(cost_s=1e-6, persist_s=0.0, step_s=0.1, mtbf_s=1.0, config=tiny) == 1
    # Never shorter than one persist (a save due meanwhile would be skipped).
    assert interval_steps(cost_s=0.001, persist_s=3.0, step_s=0.1, mtbf_s=10.0, config=CFG) == 30
    # In between: ceil(sqrt(2 x 0.02 x 100) / 0.05) = ceil(2 / 0.05) = 40.
    assert interval_steps(cost_s=0.02, persist_s=0.1, step_s=0.05, mtbf_s=100.0, config=CFG) == 40
    # No step time measured yet: the starting interval.
    assert interval_steps(cost_s=1.0, persist_s=1.0, step_s=0.0, mtbf_s=1.0, config=CFG) == 10


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"initial_steps": 5, "min_steps": 0}, "min_steps"),
        ({"initial_steps": 5, "min_steps": 6, "max_steps": 5}, "max_steps"),
        ({"initial_steps": 50, "max_steps": 40}, "initial_steps"),
        ({"initial_steps": 5, "mtbf_prior_s": 0}, "mtbf_prior_s"),
    ],
)
def test_bad_bounds_are_rejected(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        IntervalConfig(**fields)


def test_the_interval_follows_the_failure_rate_and_is_recorded(tmp_path: Path) -> None:
    sink = Sink()
    p = AdaptiveInterval(CFG, state_dir=tmp_path, ledger=sink)
    p.start(0)
    assert [s for s in range(30) if p.due(s)][:1] == [9]  # after 10 completed steps
    for _ in range(9):
        p.step_time(0.1, persisting=False)
    steps = p.saved(9, blocking_s=0.01, persist_s=None, agree=same, write=True)
    # MTBF = (0.9 s + 3600 s) / 1: sqrt(2 x 0.01 x 3600.9) = 8.49 s = 85 steps.
    assert steps == math.ceil(math.sqrt(2 * 0.01 * 3600.9) / 0.1) == 85
    assert p.next_step == 9 + 85
    for _ in range(5):
        p.restarted()  # five failures: MTBF drops, saves come sooner
    steps = p.saved(94, blocking_s=0.01, persist_s=0.2, agree=same, write=True)
    assert steps < 85
    records = [d for k, d in sink.events if k == ev.TUNED]
    assert [(r["name"], r["value"], r["previous"]) for r in records] == [
        ("ckpt_interval_steps", 85, 10),
        ("ckpt_interval_steps", steps, 85),
    ]
    assert records[-1]["failures"] == 5
    # A relaunched process keeps the failure count and adds itself.
    again = AdaptiveInterval(CFG, state_dir=tmp_path, relaunched=True)
    assert (again.failures, again.steps) == (6, steps)


def test_every_rank_gets_the_same_interval_from_the_agreed_maxima() -> None:
    """Ranks that measured different step times save at the same steps: only the agreed
    (max-reduced) figures decide."""
    ranks = [AdaptiveInterval(CFG) for _ in range(2)]
    seen: list[list[float]] = []
    agreed = [0.05, 0.0, 0.3, 3.6, 0.0]  # cost, persist, step time, training time, failures

    def agree(values: Sequence[float]) -> Sequence[float]:
        seen.append(list(values))
        return agreed

    for r, dur in zip(ranks, (0.1, 0.3), strict=True):
        r.start(0)
        for _ in range(9):
            r.step_time(dur, persisting=False)
    got = [r.saved(9, blocking_s=0.05, persist_s=None, agree=agree, write=False) for r in ranks]
    assert seen[0] != seen[1]  # their own figures differ...
    assert got[0] == got[1] == math.ceil(math.sqrt(2 * 0.05 * 3603.6) / 0.3)  # ...not the result
    assert ranks[0].next_step == ranks[1].next_step


def test_the_slowdown_while_persisting_counts_as_checkpoint_cost() -> None:
    quiet, busy = AdaptiveInterval(CFG), AdaptiveInterval(CFG)
    for p in (quiet, busy):
        p.start(0)
        for _ in range(20):
            p.step_time(0.1, persisting=False)
    for _ in range(5):
        quiet.step_time(0.1, persisting=True)
        busy.step_time(0.2, persisting=True)  # 5 steps 0.1 s slower: 0.5 s more cost
    a = quiet.saved(24, blocking_s=0.0, persist_s=0.5, agree=same, write=False)
    b = busy.saved(24, blocking_s=0.0, persist_s=0.5, agree=same, write=False)
    assert b > a
