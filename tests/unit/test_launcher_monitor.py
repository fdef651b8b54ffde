"""Heartbeats: the worker client over real UDP, and the tracker's deadlines on a scripted clock."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken import env as uenv
from unbroken.launcher import client
from unbroken.launcher import config as lconfig
from unbroken.launcher.calibrate import INITIAL_FLOOR_S, STEADY_FLOOR_S, WARMUP
from unbroken.launcher.monitor import HeartbeatServer, HeartbeatTracker, Observed
from unbroken.launcher.slowness import SENDING_LIMIT, proc_runnable_s
from unbroken.ledger.busy import proc_sent_bytes


def tracker(**kw: object) -> HeartbeatTracker:
    args: dict = {
        "enabled": True,
        "initial_timeout_s": 10.0,
        "steady_timeout_s": 2.0,
        "heartbeat_interval_s": 0.1,
    }
    args.update(kw)
    return HeartbeatTracker(**args)


def hb(
    lr: int,
    *,
    step: int | None = None,
    round_: int = 0,
    pid: int = 100,
    committed: int | None = None,
) -> dict:
    return {"lr": lr, "round": round_, "pid": pid + lr, "step": step, "committed": committed}


def test_initial_timeout_applies_once_the_job_has_heartbeated() -> None:
    t = tracker()
    t.begin_round(0, {0: (0, 100), 1: (1, 101)}, now=0.0)
    assert t.next_deadline() is None and t.overdue(1000.0) == []  # may never heartbeat
    assert t.record(hb(0, step=0), now=5.0) is True
    assert t.record(hb(0, step=1), now=5.5) is False
    assert t.next_deadline() == pytest.approx(7.5)  # rank 0 steady; rank 1 initial at 10
    t.record(hb(0, step=2), now=9.95)
    (hang,) = t.overdue(10.0)
    assert (hang.rank, hang.phase, hang.timeout_s) == (1, "initial", 10.0)
    t.begin_round(1, {0: (0, 200), 1: (1, 201)}, now=20.0)  # the job is known to heartbeat
    assert t.next_deadline() == pytest.approx(30.0)


def test_steady_timeout_and_co_suspects() -> None:
    t = tracker()
    t.begin_round(0, {0: (0, 100), 1: (1, 101), 2: (2, 102)}, now=0.0)
    t.record(hb(0, step=5), now=1.0)
    t.record(hb(1, step=5), now=1.6)
    t.record(hb(2, step=5), now=2.95)
    assert t.overdue(2.9) == []
    hangs = t.overdue(3.0)  # rank 0 is 2 s silent; rank 1 1.4 s (> half the timeout)
    assert [(h.rank, h.phase, h.last_step) for h in hangs] == [(0, "steady", 5), (1, "steady", 5)]
    t.forget(0)
    assert [h.rank for h in t.overdue(3.0)] == []


def test_a_finishing_worker_gets_the_initial_timeout_not_the_steady_one() -> None:
    """Past the last step the final save's commit and the exit are no step: a worker slower
    than the steady timeout there is not hung (measured: killed at exit, a wasted round)."""
    t = tracker()
    t.begin_round(0, {0: (0, 100), 1: (1, 101)}, now=0.0)
    t.record(hb(0, step=9), now=1.0)
    t.record(hb(1, step=9), now=1.0)
    t.record({**hb(0, step=9), "fin": True}, now=1.5)
    hangs = t.overdue(3.5)  # rank 1 is 2.5 s silent mid-training; rank 0 is finishing
    assert [(h.rank, h.phase) for h in hangs] == [(1, "steady")]
    t.forget(1)
    assert t.overdue(11.0) == []
    (hang,) = t.overdue(11.5)  # finishing still has a deadline: the initial timeout
    assert (hang.rank, hang.phase, hang.timeout_s) == (0, "finishing", 10.0)


def test_stale_and_foreign_heartbeats_are_ignored() -> None:
    t = tracker()
    t.begin_round(3, {0: (0, 100)}, now=0.0)
    assert t.record(hb(0, step=9, round_=2), now=1.0) is False
    assert t.record(hb(0, step=9, round_=3, pid=555), now=1.0) is False
    assert t.record(hb(7, step=9, round_=3), now=1.0) is False
    assert t.progress is None and not t.all_heartbeated()
    assert t.record(hb(0, step=9, round_=3), now=1.0) is True
    assert t.all_heartbeated() and t.progress == 9


def test_progress_is_the_furthest_step_reached_committed_or_not() -> None:
    """A restart resumes from the newest snapshot in memory, not the newest commit: a job whose
    restarts each get it further (steps 12, then 13, nothing committed past 10) progresses; one
    that restarts and never passes step 13 again does not."""
    t = tracker()
    t.begin_round(0, {0: (0, 100)}, now=0.0)
    t.record(hb(0, step=12), now=1.0)
    assert t.progress == 12
    t.record(hb(0, step=13, committed=10), now=2.0)
    assert t.progress == 13
    t.begin_round(1, {0: (0, 101)}, now=3.0)
    t.record(hb(0, step=11, round_=1, pid=101), now=4.0)
    assert t.progress == 13


def test_disabled_tracker_never_reports_hangs() -> None:
    t = tracker(enabled=False)
    t.begin_round(0, {0: (0, 100)}, now=0.0)
    t.record(hb(0, step=1), now=1.0)
    assert t.overdue(1e6) == [] and t.next_deadline() is None and t.progress == 1


def test_automatic_timeouts_shrink_to_observed_gaps_times_the_factor(tmp_path: Path) -> None:
    changes: list[tuple[str, float, float | None]] = []
    t = tracker(
        auto_timeouts=True,
        auto_timeout_factor=16.0,
        steady_timeout_s=60.0,
        initial_timeout_s=300.0,
        on_change=lambda *c: changes.append(c),
    )
    t.begin_round(0, {0: (0, 100)}, now=0.0)
    t.record(hb(0, step=0), now=5.0)
    assert t.effective_initial_s() == pytest.approx(16 * 5.0)  # above its 60 s floor
    for i in range(WARMUP):  # the warm-up: still the configured steady timeout
        assert t.effective_steady_s() == 60.0
        t.record(hb(0, step=i + 1), now=5.0 + 0.25 * (i + 1))
    assert t.effective_steady_s() == pytest.approx(16 * 0.25)
    assert changes == [
        ("initial_timeout_s", pytest.approx(80.0), None),
        ("steady_timeout_s", pytest.approx(4.0), None),
    ]
    # A slightly longer gap stays within the hysteresis; a gap past the timeout is a hang.
    t.record(hb(0, step=99), now=t.workers[0].last + 0.26)  # type: ignore[operator]
    assert t.effective_steady_s() == pytest.approx(4.0) and len(changes) == 2
    state = tmp_path / "launcher" / "heartbeats.json"
    t.observed.save(state)
    Observed(steady_gap_max_s=0.5, steady_samples=3).save(state)  # another agent: merged
    loaded = Observed.load(state)
    assert loaded.job_heartbeats and loaded.steady_gap_max_s == pytest.approx(0.5)
    assert loaded.steady_samples == WARMUP + 1 and loaded.initial_max_s == 5.0
    # A restarted agent starts calibrated from the file.
    again = tracker(auto_timeouts=True, steady_timeout_s=60.0, observed=loaded)
    assert again.effective_steady_s() == pytest.approx(16 * 0.5)
    assert Observed.load(tmp_path / "missing.json") == Observed()


def test_automatic_timeouts_have_floors_and_fast_steps_get_the_steady_floor() -> None:
    """70 ms steps: the agent's steady timeout becomes its floor (3 s), not 120 s; the initial
    timeout never goes below its floor however fast the start."""
    t = tracker(auto_timeouts=True, steady_timeout_s=120.0, initial_timeout_s=300.0)
    t.begin_round(0, {0: (0, 100)}, now=0.0)
    t.record(hb(0, step=0), now=0.5)
    for i in range(WARMUP):
        t.record(hb(0, step=i + 1), now=0.5 + 0.07 * (i + 1))
    assert t.effective_steady_s() == STEADY_FLOOR_S
    assert t.effective_initial_s() == INITIAL_FLOOR_S
    last = 0.5 + 0.07 * WARMUP
    assert t.overdue(last + STEADY_FLOOR_S - 0.01) == []
    (hang,) = t.overdue(last + STEADY_FLOOR_S)
    assert (hang.phase, hang.timeout_s) == ("steady", STEADY_FLOOR_S)


def test_a_restarting_worker_gets_the_configured_initial_timeout_until_its_next_step() -> None:
    """An in-process restart says "finishing" (no step for a while); the next step's
    heartbeat, without the flag, brings the steady timeout back. Neither gap is a step gap."""
    t = tracker(auto_timeouts=True, steady_timeout_s=120.0, initial_timeout_s=300.0)
    t.begin_round(0, {0: (0, 100)}, now=0.0)
    for i in range(WARMUP + 1):
        t.record(hb(0, step=i), now=1.0 + 0.1 * i)
    assert t.effective_steady_s() == STEADY_FLOOR_S
    t.record({**hb(0, step=WARMUP), "fin": True}, now=10.0)  # 8 s after the last step
    assert t.observed.steady_gap_max_s == pytest.approx(0.1)  # the restart's gap is no step
    assert t.overdue(10.0 + 299.0) == []
    t.record(hb(0, step=WARMUP + 1), now=20.0)
    assert t.observed.steady_gap_max_s == pytest.approx(0.1)
    (hang,) = t.overdue(20.0 + STEADY_FLOOR_S)
    assert hang.phase == "steady"


def test_explicit_timeouts_turn_the_automatic_ones_off() -> None:
    assert lconfig.build().auto_timeouts is True
    assert lconfig.build(steady_timeout_s=5.0).auto_timeouts is False
    assert lconfig.build(initial_timeout_s=50.0).auto_timeouts is False
    assert lconfig.build(steady_timeout_s=5.0, auto_timeouts=True).auto_timeouts is True


def test_client_sends_datagrams_the_server_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    server = HeartbeatServer()
    try:
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_ADDR, server.addr)
        monkeypatch.setenv(uenv.RANK, "3")
        monkeypatch.setenv(uenv.LOCAL_RANK, "1")
        monkeypatch.setenv(uenv.UNBROKEN_ROUND, "2")
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_INTERVAL_S, "60")
        client.reset()
        client.heartbeat(7)
        client.heartbeat(7)  # same step within the interval: dropped
        client.heartbeat(8, committed_step=4)
        client.heartbeat()  # no new step within the interval: dropped
        client.heartbeat(8, committed_step=4, finishing=True)  # a new phase: sent at once
        deadline = time.monotonic() + 5
        got: list[dict] = []
        while len(got) < 3 and time.monotonic() < deadline:
            got += server.drain()
            time.sleep(0.01)
        time.sleep(0.05)
        got += server.drain()
        assert [
            (m["rank"], m["lr"], m["round"], m["step"], m["committed"], m.get("fin")) for m in got
        ] == [(3, 1, 2, 7, None, None), (3, 1, 2, 8, 4, None), (3, 1, 2, 8, 4, True)]
    finally:
        client.reset()
        server.close()


def test_client_is_a_cheap_no_op_outside_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(uenv.UNBROKEN_HEARTBEAT_ADDR, raising=False)
    client.reset()
    client.heartbeat(1)
    assert client._get() is None
    client.reset()


class FakeRunnable:
    """Seconds run or runnable per pid, set by the test (``proc_runnable_s``'s shape)."""

    def __init__(self) -> None:
        self.used: dict[int, float] = {}

    def __call__(self, pid: int) -> float | None:
        return self.used.get(pid)


def test_a_silent_worker_that_computes_is_slow_not_hung_until_the_busy_limit() -> None:
    cpu = FakeRunnable()
    t = tracker(runnable_s=cpu)
    t.begin_round(0, {0: (0, 100), 1: (1, 101)}, now=0.0)
    t.record(hb(0, step=1), now=1.0)
    t.record(hb(1, step=1), now=1.0)
    # the agent wakes at half the timeout to start measuring (the step's own tail is before)
    assert t.next_deadline() == pytest.approx(2.0)
    cpu.used = {100: 10.0, 101: 10.0}
    assert t.overdue(2.0) == []
    assert t.next_deadline() == pytest.approx(3.0)
    # rank 0 computes (a slow step on a busy machine); rank 1 waits in a collective on it
    cpu.used = {100: 10.6, 101: 10.01}
    assert t.overdue(3.0) == []  # 2 s silent, but rank 0 used 0.6 of a core
    assert t.next_deadline() == pytest.approx(5.0)  # one more timeout for both
    cpu.used = {100: 11.4, 101: 10.02}
    assert t.overdue(5.0) == []  # still computing: 0.4 of a core
    t.record(hb(0, step=2), now=5.5)  # the slow step ends: rank 0 is no suspect any more
    t.record(hb(1, step=2), now=5.5)
    assert t.next_deadline() == pytest.approx(6.5)  # back to the steady timeout
    assert t.overdue(6.5) == []
    # spinning without progress is a hang too: at most BUSY_LIMIT timeouts of silence
    for now in (7.5, 9.5, 11.5):
        cpu.used = {100: cpu.used[100] + 2.0, 101: 10.05}
        assert t.overdue(now) == []
    cpu.used = {100: cpu.used[100] + 2.0, 101: 10.05}
    hangs = t.overdue(13.5)
    assert [(h.rank, h.silent_s) for h in hangs] == [(0, 8.0), (1, 8.0)]
    assert hangs[0].runnable == pytest.approx(1.0)


def test_a_silent_node_that_waits_is_hung_at_the_timeout() -> None:
    cpu = FakeRunnable()
    cpu.used = {100: 5.0, 101: 5.0}
    t = tracker(runnable_s=cpu)
    t.begin_round(0, {0: (0, 100), 1: (1, 101)}, now=0.0)
    t.record(hb(0, step=1), now=1.0)
    t.record(hb(1, step=1), now=1.2)
    assert t.overdue(2.0) == []  # rank 0 a suspect: measured from here
    cpu.used = {100: 5.0, 101: 5.5}  # rank 1 ends its step's tail before it is a suspect
    assert t.overdue(2.2) == []
    cpu.used = {100: 5.01, 101: 5.505}  # a sleeping loop, and a peer blocked on it
    hangs = t.overdue(3.0)
    assert [h.rank for h in hangs] == [0, 1]
    assert [h.runnable for h in hangs] == [pytest.approx(0.01), pytest.approx(0.00625)]
    # a process /proc cannot read (gone) is not busy; nor is one without a clock
    t2 = tracker()
    t2.begin_round(0, {0: (0, 100)}, now=0.0)
    t2.record(hb(0, step=1), now=1.0)
    (h,) = t2.overdue(3.0)
    assert h.runnable is None


@pytest.mark.slow
@pytest.mark.serial
def test_proc_runnable_s_counts_time_running_and_waiting_for_a_cpu(tmp_path: Path) -> None:
    """A process computing is runnable all the time, even when it waits for a CPU most of it;
    a sleeping one is not. Real processes: a spin loop among more spin loops than CPUs, and a
    sleep."""
    code = "import sys, time\nif sys.argv[1] == 'spin':\n    while True: pass\ntime.sleep(60)"
    cores = os.cpu_count() or 1
    spin = [subprocess.Popen([sys.executable, "-c", code, "spin"]) for _ in range(2 * cores + 1)]
    sleep = subprocess.Popen([sys.executable, "-c", code, "sleep"])
    try:
        time.sleep(0.3)  # started
        before = {p.pid: proc_runnable_s(p.pid) for p in (spin[0], sleep)}
        time.sleep(1.0)
        after = {p.pid: proc_runnable_s(p.pid) for p in (spin[0], sleep)}
    finally:
        for p in (*spin, sleep):
            p.kill()
            p.wait()
    spun = after[spin[0].pid] - before[spin[0].pid]
    slept = after[sleep.pid] - before[sleep.pid]
    assert spun >= 0.8, spun  # it ran on at most about half of that second
    assert slept < 0.05, slept
    assert proc_runnable_s(spin[0].pid) is None  # gone


def test_a_silent_worker_that_sends_is_slow_not_hung_until_the_sending_limit() -> None:
    """A collective over a degraded network: both ranks sleep in the kernel while their data
    trickles out (no CPU, but bytes written); a hung collective writes nothing."""
    cpu, sent = FakeRunnable(), FakeRunnable()
    cpu.used = {100: 5.0, 101: 5.0}
    sent.used = {100: 1e6, 101: 1e6}
    t = tracker(runnable_s=cpu, sent_bytes=sent)
    t.begin_round(0, {0: (0, 100), 1: (1, 101)}, now=0.0)
    t.record(hb(0, step=1), now=1.0)
    t.record(hb(1, step=1), now=1.0)
    assert t.overdue(2.0) == []  # suspects from here
    sent.used = {100: 1e6 + 200e3, 101: 1e6 + 200e3}  # 200 kB/s each
    assert t.overdue(3.0) == []  # 2 s silent, sending
    assert t.next_deadline() == pytest.approx(5.0)
    now = 3.0
    while now + 2.0 < 1.0 + SENDING_LIMIT * 2.0:  # extended a timeout at a time
        now += 2.0
        sent.used = {k: v + 400e3 for k, v in sent.used.items()}
        assert t.overdue(now) == [], now
    now += 2.0
    sent.used = {k: v + 400e3 for k, v in sent.used.items()}
    hangs = t.overdue(now)  # a link that never delivers a step: a hang in the end
    assert [h.rank for h in hangs] == [0, 1] and hangs[0].sending == pytest.approx(200e3)
    # the data stops flowing: hung at the next deadline
    t.record(hb(0, step=2), now=100.0)
    t.record(hb(1, step=2), now=100.0)
    assert t.overdue(101.0) == []  # suspects: measured from here
    hangs = t.overdue(102.0)
    assert [h.rank for h in hangs] == [0, 1] and hangs[0].sending == 0.0


def test_a_silent_worker_waiting_out_a_tcp_retransmission_is_slow_not_hung() -> None:
    """A lossy link: TCP waits out a retransmission timeout and nothing is written (seen under
    CI load: 70 B/s over a whole timeout); a connection in that state gives the worker time,
    for at most SENDING_LIMIT timeouts; without it, the silence is a hang."""
    cpu, sent = FakeRunnable(), FakeRunnable()
    cpu.used = {100: 5.0, 101: 5.0}
    sent.used = {100: 1e6, 101: 1e6}
    waiting = {100: True, 101: False}
    t = tracker(runnable_s=cpu, sent_bytes=sent, retransmitting=lambda pid: waiting[pid])
    t.begin_round(0, {0: (0, 100), 1: (1, 101)}, now=0.0)
    t.record(hb(0, step=1), now=1.0)
    t.record(hb(1, step=1), now=1.0)
    assert t.overdue(2.0) == []
    assert t.overdue(3.0) == []  # nothing written, rank 0's connection waits out an RTO
    now = 3.0
    while now + 2.0 < 1.0 + SENDING_LIMIT * 2.0:
        now += 2.0
        assert t.overdue(now) == [], now
    assert [h.rank for h in t.overdue(now + 2.0)] == [0, 1]  # the limit
    waiting[100] = False
    t.record(hb(0, step=2), now=100.0)
    t.record(hb(1, step=2), now=100.0)
    t.overdue(101.0)
    hangs = t.overdue(102.0)  # no connection waits: hung
    assert [h.rank for h in hangs] == [0, 1] and hangs[0].retransmitting is False


def test_a_silent_worker_whose_watchdog_says_it_waits_on_the_network_is_given_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver on a lossy link shows the agent nothing in /proc (no bytes written, no data
    under a retransmission timer); its own watchdog sees the link at work and says so
    (``client.waiting``, over the real socket, signed): the agent waits, for at most
    SENDING_LIMIT timeouts, and the word is no heartbeat (the silence goes on). Without it, or
    once it has stopped, the silence is a hang."""
    key = HeartbeatServer.new_key()
    server = HeartbeatServer(key=key)
    try:
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_ADDR, server.addr)
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_KEY, key.hex())
        monkeypatch.setenv(uenv.RANK, "0")
        monkeypatch.setenv(uenv.LOCAL_RANK, "0")
        monkeypatch.setenv(uenv.UNBROKEN_ROUND, "0")
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_INTERVAL_S, "60")
        client.reset()
        client.waiting("slow network, not hung: its connections lost 7 segment(s) meanwhile")
        client.waiting("again")  # within half an interval: dropped
        deadline = time.monotonic() + 5
        got: list[dict] = []
        while not got and time.monotonic() < deadline:
            got += server.drain()
            time.sleep(0.01)
        time.sleep(0.05)
        got += server.drain()
    finally:
        client.reset()
        server.close()
    assert len(got) == 1 and got[0]["wait"].endswith("lost 7 segment(s) meanwhile")
    word = got[0]

    cpu, sent = FakeRunnable(), FakeRunnable()
    cpu.used = {os.getpid(): 5.0, 101: 5.0}
    sent.used = {os.getpid(): 1e6, 101: 1e6}  # nothing written by either
    t = tracker(runnable_s=cpu, sent_bytes=sent, retransmitting=lambda pid: False)
    t.begin_round(0, {0: (0, os.getpid()), 1: (1, 101)}, now=0.0)
    t.record({**hb(0, step=1), "pid": os.getpid()}, now=1.0)
    t.record(hb(1, step=1), now=1.0)
    assert t.overdue(2.0) == []
    assert t.record(word, now=2.9) is False
    assert t.overdue(3.0) == []  # 2 s silent, but its watchdog said it waits on the network
    now = 3.0
    while now + 2.0 < 1.0 + SENDING_LIMIT * 2.0:  # said again and again: a timeout at a time
        now += 2.0
        t.record(word, now=now - 0.05)
        assert t.overdue(now) == [], now
    now += 2.0
    t.record(word, now=now - 0.05)
    hangs = t.overdue(now)  # a link that never delivers a step: a hang in the end
    assert [h.rank for h in hangs] == [0, 1] and hangs[0].vouched == word["wait"]
    assert hangs[0].silent_s == pytest.approx(now - 1.0)  # the words were no heartbeats
    t.record({**hb(0, step=2), "pid": os.getpid()}, now=100.0)
    t.record(hb(1, step=2), now=100.0)
    t.record(word, now=100.5)  # said once, then no more: stale by the deadline
    t.overdue(101.0)
    hangs = t.overdue(102.0)
    assert [h.rank for h in hangs] == [0, 1] and hangs[0].vouched is None


_WRITE_UNTIL_FULL = """
import os, socket, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.setblocking(False)
written = 0
while True:
    try:
        written += os.write(sock.fileno(), b"x" * 65536)
    except BlockingIOError:
        break
print(written, flush=True)
time.sleep(60)
"""


def _wchar(pid: int) -> int:
    io = Path(f"/proc/{pid}/io").read_text()
    return int(next(ln for ln in io.splitlines() if ln.startswith("wchar:")).split()[1])


def test_proc_sent_bytes_counts_a_sockets_bytes_once_its_peer_has_them() -> None:
    """A collective over a slow link writes a socket buffer's worth at once, then waits while
    it trickles out: bytes count as sent once the peer acknowledges them, not when written."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITE_UNTIL_FULL, str(port)], stdout=subprocess.PIPE
        )
        try:
            conn, _ = server.accept()
            with conn:
                assert proc.stdout is not None
                written = int(proc.stdout.readline())
                sent = proc_sent_bytes(proc.pid)  # the peer reads nothing: the buffers fill
                assert sent is not None and sent < written <= _wchar(proc.pid), (sent, written)
                got = 0
                while got < written:
                    got += len(conn.recv(1 << 20))
                deadline = time.monotonic() + 10
                while proc_sent_bytes(proc.pid) != _wchar(proc.pid):
                    assert time.monotonic() < deadline, (proc_sent_bytes(proc.pid), written)
                    time.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()


def test_proc_sent_bytes_counts_what_a_process_writes(tmp_path: Path) -> None:
    code = "import os, sys, time\nos.write(1, b'x' * 100000)\ntime.sleep(60)"
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out)
        try:
            deadline = time.monotonic() + 10
            while (proc_sent_bytes(proc.pid) or 0) < 100000:
                assert time.monotonic() < deadline, proc_sent_bytes(proc.pid)
                time.sleep(0.02)
        finally:
            proc.kill()
            proc.wait()
    assert proc_sent_bytes(proc.pid) is None  # gone
