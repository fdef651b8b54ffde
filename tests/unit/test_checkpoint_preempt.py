"""The graceful stop's agreement: every rank stops at the first asker's step + MARGIN, a
previous launch's agreement is replaced, and nothing is asked until SIGTERM came."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from unbroken.checkpoint import preempt
from unbroken.errors import Preempted
from unbroken.ledger import Ledger, read_events


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    preempt.clear()
    yield
    preempt.clear()


def test_ranks_a_step_apart_agree_on_the_first_askers_step_plus_the_margin(
    tmp_path: Path,
) -> None:
    first = preempt.target(tmp_path, run="r", step=5)
    assert first == 5 + preempt.MARGIN
    assert preempt.target(tmp_path, run="r", step=6) == first  # the rank a step ahead
    assert preempt.target(tmp_path, run="r", step=4) == first  # and one behind
    assert preempt.target(tmp_path, run="other", step=9) == 9 + preempt.MARGIN  # per run


def test_fast_steps_stop_far_enough_ahead_for_the_other_nodes_to_hear_of_it(
    tmp_path: Path,
) -> None:
    """At 10 ms a step, two steps would pass before another node's agent passes the SIGTERM
    on: the target is REACH_S of steps ahead instead; slow steps keep MARGIN."""
    assert preempt.target(tmp_path, run="fast", step=100, step_s=0.01) == 100 + 100
    assert preempt.target(tmp_path, run="slow", step=100, step_s=2.0) == 100 + preempt.MARGIN
    stop = preempt.Stop(tmp_path, "paced")
    assert not stop.due(7)
    preempt.request()
    assert not stop.due(8)  # a step at the pace of these two calls: far under REACH_S
    assert stop.target is not None and stop.target > 8 + preempt.MARGIN


def test_a_previous_launchs_agreement_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / ".preempt-r"
    path.write_text(json.dumps({"step": 3}))
    old = preempt._IMPORTED - 60
    os.utime(path, (old, old))  # written before this process: a previous launch's
    assert preempt.target(tmp_path, run="r", step=40) == 40 + preempt.MARGIN


def test_storage_that_cannot_be_written_stops_where_the_rank_is(tmp_path: Path) -> None:
    assert preempt.target(tmp_path / "missing" / "dir", run="r", step=8) == 8


def test_nothing_is_due_until_requested_then_the_agreed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preempt, "REACH_S", 0.0)  # the steps here take microseconds
    stop = preempt.Stop(tmp_path, "r")
    assert not stop.due(3) and not (tmp_path / ".preempt-r").exists()
    preempt.request()
    assert not stop.due(4) and stop.target == 6
    assert not stop.due(5) and stop.due(6)


def test_stopped_records_the_last_save_and_raises(tmp_path: Path) -> None:
    preempt.request(ts=100.0)
    led = Ledger(tmp_path, run="r", rank=0)
    with pytest.raises(Preempted, match="step 6 is committed"):
        preempt.stopped(6, began=100.5, ledger=led, failed=None, latest=6)
    with pytest.raises(Preempted, match=r"failed \(ENOSPC\).*newest committed checkpoint \(2\)"):
        preempt.stopped(7, began=101.0, ledger=led, failed="ENOSPC", latest=2)
    led.close()
    phases = [e for e in read_events(tmp_path) if e.kind == "phase"]
    assert [(e.get("step"), e.get("durable"), e.get("signal_s")) for e in phases] == [
        (6, True, 0.5),
        (7, False, 1.0),
    ]
    assert Preempted.exit_code == 143
