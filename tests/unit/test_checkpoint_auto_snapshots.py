"""Memory snapshots between durable saves at the interval a share of step time allows
(``CheckpointConfig.snapshot_budget``): the interval's arithmetic, the policy on a given
clock, and a real Checkpointer whose ``maybe_save`` snapshots at it."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from toy import mlp, train_step
from unbroken.checkpoint import CheckpointConfig, Checkpointer
from unbroken.checkpoint.schedule.snapshots import WARMUP, AutoSnapshots, interval
from unbroken.ledger import Ledger, read_events
from unbroken.ledger import events as ev

pytestmark = pytest.mark.timeout(60)


def test_the_interval_keeps_the_stall_within_the_budget() -> None:
    assert interval(0.001, 0.1, 0.01) == 1  # 1 ms of a 100 ms step: 1% at every step
    assert interval(0.01, 0.1, 0.01) == 10
    assert interval(0.0101, 0.1, 0.01) == 11  # never over the budget
    assert interval(0.5, 2.0, 0.01) == 25  # a 2 s step staging 0.5 s
    assert interval(0.0, 0.1, 0.01) == 1
    assert interval(0.01, 0.0, 0.01) is None  # no step measured
    assert interval(0.01, 0.1, 0.0) is None  # no budget


def _clock(times: list[float]):
    it = iter(times)
    return lambda: next(it)


def test_the_policy_snapshots_from_the_last_save_at_the_agreed_interval() -> None:
    agreed: list[list[float]] = []

    def agree(values):
        agreed.append(list(values))
        return [max(v, 0.004) if i == 0 else v for i, v in enumerate(values)]  # a slower rank

    # steps of 0.1 s; the save at step 4 stalls 2 ms here, 4 ms on another rank
    auto = AutoSnapshots(0.01, 20, agree, clock=_clock([0.1 * i for i in range(100)]))
    assert [auto.step(s) for s in range(5)] == [False] * 5  # nothing before a save
    auto.saved(4, stall_s=0.002)
    assert agreed == [[0.002, pytest.approx(0.1)]]
    assert auto.interval == 4 and auto.anchor == 4  # ceil(0.004 / (0.01 x 0.1))
    due = [s for s in range(5, 24) if auto.step(s)]
    assert due == [8, 12, 16, 20]
    # An interval that reaches the next durable save snapshots nothing in between.
    auto.saved(24, stall_s=0.05)
    assert auto.interval is None and not any(auto.step(s) for s in range(25, 44))


def test_a_snapshot_that_blocked_longer_than_the_save_sets_the_next_interval() -> None:
    agreed: list[list[float]] = []

    def agree(values):
        agreed.append(list(values))
        return list(values)

    auto = AutoSnapshots(0.01, 100, agree, clock=_clock([0.1 * i for i in range(300)]))
    [auto.step(s) for s in range(10)]
    auto.saved(9, stall_s=0.0019)
    assert auto.interval == 2  # ceil(0.0019 / (0.01 x 0.1))
    due = [s for s in range(10, 110) if auto.step(s)]
    auto.snapshotted(due[0], stall_s=0.0059)  # waited on a slower rank's agreement
    auto.snapshotted(due[1], stall_s=0.001)
    auto.saved(109, stall_s=0.0019)
    assert agreed[-1][0] == 0.0059 and auto.interval == 6  # the longest since the last save
    auto.saved(209, stall_s=0.0019)
    assert agreed[-1][0] == 0.0019 and auto.interval == 2  # counted once


def test_a_fixed_interval_no_budget_or_no_memory_tier_leave_it_off() -> None:
    assert AutoSnapshots.of(CheckpointConfig(every_steps=5), list) is not None  # the default
    assert AutoSnapshots.of(CheckpointConfig(snapshot_every=2), list) is None
    assert AutoSnapshots.of(CheckpointConfig(snapshot_budget=0.0), list) is None
    assert AutoSnapshots.of(CheckpointConfig(memory_tier=False, memory_slots=1), list) is None
    with pytest.raises(ValueError, match="snapshot_budget must be in"):
        CheckpointConfig(snapshot_budget=1.0)


def _stages(run: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"save": [], "snapshot": [], "note": []}
    for e in read_events(run):
        if e.kind != ev.CKPT_STAGE:
            continue
        kind = "note" if e.get("part") == "note" else "save" if e.get("durable") else "snapshot"
        out[kind].append(int(e.get("step")))
    return out


def _train(tmp_path: Path, *, steps: int, every_steps: int, budget: float) -> dict[str, list[int]]:
    """``steps`` steps of 50 ms through ``maybe_save``; what it staged and noted, by step."""
    led = Ledger(tmp_path / "run", run="auto", rank=0)
    model, optim = mlp(0)
    state = {"model": model, "optim": optim}
    cfg = CheckpointConfig(every_steps=every_steps, snapshot_budget=budget)
    with Checkpointer(tmp_path / "ckpt", config=cfg, ledger=led) as ck:
        for step in range(steps):
            train_step(model, optim)
            time.sleep(0.05)  # a step of 50 ms
            ck.maybe_save(step, state)
            if step % every_steps == every_steps - 1:
                ck.wait()  # persisted before the next save: none skipped as still persisting
    led.close()
    assert not any(torch.isnan(p).any() for p in itertools.chain(model.parameters()))
    return _stages(tmp_path / "run")


@pytest.mark.parametrize(("budget", "snapshots"), [(0.9, True), (1e-6, False)])
def test_maybe_save_snapshots_between_saves_as_the_budget_allows(
    tmp_path: Path, budget: float, snapshots: bool
) -> None:
    got = _train(tmp_path, steps=15, every_steps=5, budget=budget)
    assert got["save"] == [4, 9, 14]
    # Every step neither saved nor snapshotted is noted, from the first: its resolve (the
    # first step that is no save) learned what a note tracks.
    assert set(got["note"]) == set(range(14)) - {4, 9} - set(got["snapshot"])
    if not snapshots:  # 1e-6 of a step allows none before the next save
        assert got["snapshot"] == []
        return
    # After the first save (its stall holds the arena's allocation) at a steady interval n
    # from it; after the second (a stall of a few ms, 0.9 of 50 ms allowed) at every step.
    first = [s for s in got["snapshot"] if s < 9]
    if first:
        n = first[0] - 4
        assert first == list(range(4 + n, 9, n))
    assert [s for s in got["snapshot"] if s > 9] == [10, 11, 12, 13]


def test_before_a_far_first_save_two_probes_set_the_interval() -> None:
    # Steps of 0.1 s, the first durable save 100 steps away: after WARMUP steps timed, the
    # next two are snapshotted (the probes), and the lesser stall sets the interval.
    agreed: list[list[float]] = []
    clock = _clock([0.1 * i for i in range(100)])
    auto = AutoSnapshots(0.01, 100, lambda v: agreed.append(list(v)) or list(v), clock=clock)
    due = [s for s in range(WARMUP + 1) if auto.step(s)]
    assert due == [WARMUP] and auto.probing  # a probe: WARMUP step times before it
    auto.probed(WARMUP, stall_s=0.5)  # the first: the arena's allocation, not agreed
    assert agreed == [] and auto.step(WARMUP + 1)  # the second probe
    auto.probed(WARMUP + 1, stall_s=0.0015)  # ceil(0.0015 / (0.01 x 0.1)): every 2 steps
    assert not auto.probing and agreed == [[0.0015, pytest.approx(0.1)]]
    assert [s for s in range(WARMUP + 2, 20) if auto.step(s)] == [11, 13, 15, 17, 19]
    # A durable save within 2 x WARMUP steps comes soon enough: no probe.
    near = AutoSnapshots(0.01, 2 * WARMUP, list, clock=_clock([0.1 * i for i in range(100)]))
    assert not any(near.step(s) for s in range(2 * WARMUP - 1))


@pytest.mark.parametrize(("budget", "after"), [(0.9, True), (1e-6, False)])
def test_a_checkpointer_whose_first_save_is_far_off_snapshots_from_the_probes(
    tmp_path: Path, budget: float, after: bool
) -> None:
    got = _train(tmp_path, steps=WARMUP + 6, every_steps=100, budget=budget)
    assert got["save"] == []
    # The probes; then every step (a few ms of 0.9 x 50 ms), or none before the save.
    rest = list(range(WARMUP + 2, WARMUP + 6)) if after else []
    assert got["snapshot"] == [WARMUP, WARMUP + 1, *rest]
