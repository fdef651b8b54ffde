"""``unbroken bench restart``'s restore figure: the critical path of the restart's restore,
computed from the ranks' ``ckpt_load`` records alone."""

from __future__ import annotations

import pytest

from unbroken.bench.restart import restore_path
from unbroken.ledger import events as ev
from unbroken.ledger.events import Event


def _load(rank: int, attempt: int, begin: float, end: float) -> Event:
    return Event(kind=ev.CKPT_LOAD, ts=end, rank=rank, attempt=attempt, data={"dur_s": end - begin})


def test_the_restore_runs_from_the_last_ranks_start_to_the_last_ranks_end() -> None:
    # Rank 0 starts at 10.0 and waits for rank 1 (still building its model) until 10.11;
    # rank 1 restores from 10.11 to 10.15, rank 0 is done at 10.155.
    loads = [_load(0, 1, 10.0, 10.155), _load(1, 1, 10.11, 10.15)]
    got = restore_path(loads)
    assert got["restore_s"] == pytest.approx(0.045)
    assert got["restore_wait_s"] == pytest.approx(0.11)
    assert got["restore_rank_s"] == pytest.approx(0.155)


def test_only_the_first_restarted_attempt_counts_and_nothing_gives_none() -> None:
    loads = [_load(0, 2, 50.0, 59.0), _load(0, 1, 10.0, 10.2), _load(1, 1, 10.05, 10.1)]
    got = restore_path(loads)
    assert got["restore_s"] == pytest.approx(0.15)
    assert got["restore_wait_s"] == pytest.approx(0.05)
    assert restore_path([]) == {"restore_s": None, "restore_wait_s": None, "restore_rank_s": None}
