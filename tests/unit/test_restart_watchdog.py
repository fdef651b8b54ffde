"""The watchdog's decisions, driven by a fake clock."""

from __future__ import annotations

import pytest

from unbroken.restart import RestartConfig
from unbroken.restart.lossy import Loss
from unbroken.restart.watchdog import (
    EXIT_TIMEOUT,
    HANG,
    KILL,
    NONE,
    RESTART,
    STUCK,
    Watchdog,
)

CFG = RestartConfig(
    soft_timeout_s=1.0,
    hard_timeout_s=3.0,
    initial_soft_timeout_s=10.0,
    initial_hard_timeout_s=20.0,
    exit_timeout_s=2.0,
    barrier_timeout_s=30.0,
    monitor_interval_s=0.01,
)


def armed(now: float = 0.0) -> Watchdog:
    w = Watchdog(CFG)
    w.arm(now)
    return w


def test_quiet_when_disarmed_or_progressing() -> None:
    w = Watchdog(CFG)
    assert w.evaluate(100.0, silent_s=100.0).action == NONE
    w = armed()
    w.progress(0.5, step=True)
    assert w.evaluate(1.4, silent_s=0.0).action == NONE


def test_initial_timeouts_apply_until_the_first_step() -> None:
    w = armed()
    assert w.evaluate(9.0, silent_s=0.0).action == NONE
    assert w.evaluate(10.5, silent_s=0.0).action == RESTART
    w.progress(10.6, step=False)  # a heartbeat is not a step
    assert w.evaluate(12.0, silent_s=0.0).action == NONE
    w.progress(12.0, step=True)
    assert w.evaluate(13.1, silent_s=0.0).action == RESTART


def test_hang_versus_stuck_by_whether_python_runs() -> None:
    w = armed()
    w.progress(0.0, step=True)
    v = w.evaluate(1.2, silent_s=0.0)
    assert (v.action, v.kind, v.main_state) == (RESTART, HANG, "python")
    v = w.evaluate(1.2, silent_s=1.2)
    assert (v.action, v.kind, v.main_state) == (RESTART, STUCK, "native")
    assert "no progress for 1.200s" in v.describe()


def test_hard_timeout_kills() -> None:
    w = armed()
    w.progress(0.0, step=True)
    assert w.evaluate(3.5, silent_s=3.5).action == KILL
    assert w.deadline() == 3.0


def test_after_a_request_fn_must_exit_within_the_exit_timeout() -> None:
    w = armed()
    w.progress(0.0, step=True)
    w.requested(0.5)
    assert w.evaluate(2.0, silent_s=2.0).action == NONE  # no second restart
    assert w.deadline() == 2.5
    v = w.evaluate(2.6, silent_s=2.6)
    assert (v.action, v.kind) == (KILL, EXIT_TIMEOUT)


def test_no_hang_protection_suspends_both_timeouts_and_restarts_the_clock() -> None:
    w = armed()
    w.progress(0.0, step=True)
    w.protect(0.5, enter=True)
    w.protect(0.6, enter=True)
    assert w.evaluate(50.0, silent_s=50.0).action == NONE
    assert w.deadline() is None
    w.protect(50.0, enter=False)
    assert w.evaluate(60.0, silent_s=0.0).action == NONE
    w.protect(60.0, enter=False)
    assert w.evaluate(60.9, silent_s=0.0).action == NONE
    assert w.evaluate(61.1, silent_s=0.0).action == RESTART
    w.requested(61.1)
    w.protect(61.2, enter=True)  # a requested restart is still enforced
    assert w.evaluate(63.2, silent_s=0.0).action == KILL


def test_suspect_owns_up_to_a_hang_before_the_verdict() -> None:
    w = armed()
    w.progress(0.0, step=True)
    assert w.suspect(0.4, silent_s=0.0) is None
    assert w.suspect(0.6, silent_s=0.0) == HANG
    assert w.suspect(0.6, silent_s=0.6) == STUCK
    w.requested(0.7)
    assert w.suspect(0.8, silent_s=0.0) is None


def test_a_rank_that_sends_is_slow_not_hung() -> None:
    """A collective crawling over a degraded network writes; a hung one writes nothing."""
    sent = [0]
    w = Watchdog(CFG, sent_bytes=lambda: sent[0])
    w.arm(0.0)
    w.progress(0.0, step=True)
    assert w.evaluate(0.6, silent_s=0.6).action == NONE  # a suspect: bytes counted from here
    sent[0] = 10_000  # 20 kB/s
    assert w.evaluate(1.1, silent_s=1.1).action == NONE
    assert w.sending_bps == pytest.approx(20_000)
    assert w.waiting_why() == "this rank is sending 20 kB/s"  # what the launcher is told
    deadline = w.deadline()
    assert deadline is not None and deadline > 30.0  # the backstop waits too
    assert w.evaluate(2.5, silent_s=2.5).action == NONE  # 5.3 kB/s on average: still sending
    assert w.evaluate(3.5, silent_s=3.5).action == KILL  # 3.4 kB/s: it stopped, past hard
    w.progress(3.6, step=True)
    assert w.sending_bps is None and w.waiting_why() is None


def test_a_rank_that_sends_nothing_is_hung_and_sending_has_a_limit() -> None:
    sent = [0]
    w = Watchdog(CFG, sent_bytes=lambda: sent[0])
    w.arm(0.0)
    w.progress(0.0, step=True)
    w.evaluate(0.6, silent_s=0.6)
    assert w.evaluate(1.1, silent_s=1.1).action == RESTART  # wrote nothing: hung
    w = Watchdog(CFG, sent_bytes=lambda: sent[0])
    w.arm(0.0)
    w.progress(0.0, step=True)
    w.evaluate(0.6, silent_s=0.6)
    t = 1.0
    while t < 31.0:  # a link that never delivers a step: waited for SENDING_LIMIT timeouts
        sent[0] += 10_000
        assert w.evaluate(t, silent_s=t).action == NONE, t
        t += 1.0
    sent[0] += 10_000
    assert w.evaluate(31.5, silent_s=31.5).action == KILL


def test_a_silent_rank_whose_connections_lose_segments_is_slow_not_hung() -> None:
    """TCP waiting out a retransmission timeout writes nothing; the lost segments excuse the
    silence, for at most SENDING_LIMIT timeouts, and not once a peer is unreachable."""
    lost = {7: 0}
    unreachable = [False]
    w = Watchdog(CFG, sent_bytes=lambda: 0, link_loss=lambda: Loss(dict(lost), unreachable[0]))
    w.arm(0.0)
    w.progress(0.0, step=True)
    assert w.evaluate(0.05, silent_s=0.05).action == NONE  # the reading at the clock's start
    w.evaluate(0.6, silent_s=0.6)
    assert w.evaluate(1.1, silent_s=1.1).action == RESTART  # nothing lost: hung
    w = Watchdog(CFG, sent_bytes=lambda: 0, link_loss=lambda: Loss(dict(lost), unreachable[0]))
    w.arm(0.0)
    w.progress(0.0, step=True)
    w.evaluate(0.05, silent_s=0.05)
    lost[7] = 3  # resent three segments
    assert w.evaluate(1.1, silent_s=1.1).action == NONE
    assert w.lost_segments == 3 and w.sending_bps is None
    assert w.waiting_why() == "its connections lost 3 segment(s) meanwhile"
    deadline = w.deadline()
    assert deadline is not None and deadline > 30.0  # the backstop waits too
    assert w.evaluate(2.5, silent_s=2.5).action == NONE
    unreachable[0] = True  # the peer stopped acknowledging: its node is gone
    assert w.evaluate(2.6, silent_s=2.6).action == RESTART
    unreachable[0] = False
    w.progress(3.0, step=True)
    assert w.waiting_why() is None
    w.evaluate(3.05, silent_s=0.0)  # a new reading: the old loss no longer counts
    assert w.evaluate(4.2, silent_s=1.2).action == RESTART
    t = 5.0
    w.progress(t, step=True)
    w.evaluate(t + 0.05, silent_s=0.0)
    while t < 5.0 + 29.0:  # segments lost all along, for nearly SENDING_LIMIT timeouts
        lost[7] += 1
        t += 1.0
        assert w.evaluate(t, silent_s=t).action == NONE, t
    lost[7] += 1
    assert w.evaluate(5.0 + 30.5, silent_s=t).action == KILL  # the limit
