"""Heartbeat monitoring at scale: one real launcher agent watching n ranks' heartbeats.

The agent is ``launcher.agent.Agent`` with its real ``HeartbeatServer`` (UDP, loopback) and
``HeartbeatTracker``; what is stood in: the workers. One sender process (no torch) writes the
datagrams of all n ranks in the client's wire format (``launcher.client``: the same fields),
one per rank per step of ``period_s``, each rank at its own phase of the step (heartbeats
spread evenly: the agent wakes most often); the workers port around it starts nothing and
"kills" by recording. One rank falls silent after ``silent_after_s``; measured:

- detection latency: its last datagram -> the agent's kill (the steady timeout plus the
  overshoot, which is the agent's doing);
- the agent's CPU seconds per second (``time.process_time`` of this process while it runs
  the agent, steady window before the detection);
- datagrams received / sent (a socket buffer overflow would show here).
"""

from __future__ import annotations

import json
import logging
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.launcher import args as largs
from unbroken.launcher.agent import Agent
from unbroken.launcher.client import VERSION
from unbroken.launcher.config import LauncherConfig
from unbroken.launcher.monitor import HeartbeatServer, HeartbeatTracker
from unbroken.launcher.rendezvous import RoundInfo
from unbroken.launcher.workers import Events, WorkerExit

PID_BASE = 4_000_000  # fake worker pids (above pid_max): the datagrams carry them


def datagram(*, rank: int, step: int) -> bytes:
    """One heartbeat as ``launcher.client`` writes it (rank = local rank; round 0)."""
    msg = {
        "v": VERSION,
        "rank": rank,
        "lr": rank,
        "pid": PID_BASE + rank,
        "round": 0,
        "step": step,
        "committed": None,
        "ts": time.time(),
    }
    return json.dumps(msg, separators=(",", ":")).encode()


def sender(
    host: str, port: int, n: int, period_s: float, silent: int, silent_after_s: float
) -> None:
    """Send every rank's heartbeat once per ``period_s``, spread over the period, until killed;
    rank ``silent`` stops after ``silent_after_s``. Prints the datagrams sent on SIGTERM."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sent = 0

    def stop(*_: Any) -> None:
        print(json.dumps({"sent": sent}), flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    t0 = time.monotonic()
    k = 0  # datagrams due so far: k // n is the step, k % n the rank
    while True:
        now = time.monotonic()
        due = int((now - t0) / period_s * n)
        while k <= due:
            rank, step = k % n, k // n
            k += 1
            if rank == silent and now - t0 >= silent_after_s:
                continue
            try:
                sock.sendto(datagram(rank=rank, step=step), (host, port))
                sent += 1
            except OSError:
                pass
        time.sleep(min(0.002, period_s / n))


class _Rdzv:
    def __init__(self, n: int) -> None:
        self.n = n

    def next_round(self) -> RoundInfo:
        return RoundInfo(
            round=0,
            group_rank=0,
            group_world_size=1,
            rank_offset=0,
            world_size=self.n,
            master_addr="127.0.0.1",
            master_port=1,
            store_addr="127.0.0.1:1",
        )

    def membership(self) -> tuple[int, list[str]]:
        return 0, []

    def announce_preemption(self, info: RoundInfo) -> None:
        pass

    def peer_preempted(self, round_: int) -> bool:
        return False

    def exit_barrier(self, info: RoundInfo) -> None:
        pass

    def leave(self) -> None:
        pass

    def close(self) -> None:
        pass


class _StandInWorkers:
    """The agent's workers port: heartbeats from the sender process, kills recorded."""

    warm = True
    standby = 0

    def __init__(self, n: int, *, period_s: float, silent: int, silent_after_s: float) -> None:
        self.n, self.period_s, self.silent, self.silent_after_s = (
            n,
            period_s,
            silent,
            silent_after_s,
        )
        self.server = HeartbeatServer()
        self.server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self.proc: subprocess.Popen[str] | None = None
        self.received = 0
        self.silent_last_ts: float | None = None
        self.killed: list[int] = []
        self.kill_ts: float | None = None
        self.cpu0: tuple[float, float] | None = None
        self.cpu1: tuple[float, float] | None = None
        self.started = 0.0
        self.sent = 0

    def interruptible(self, on: bool) -> None:
        pass

    def start(self, info: RoundInfo) -> dict[int, tuple[int, int]]:
        host, port = self.server.addr.rsplit(":", 1)
        code = (
            "from unbroken.bench.scale_heartbeat import sender; "
            f"sender({host!r}, {port}, {self.n}, {self.period_s}, {self.silent}, "
            f"{self.silent_after_s})"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
        )
        self.started = time.monotonic()
        return {lr: (lr, PID_BASE + lr) for lr in range(self.n)}

    def wait(self, timeout_s: float) -> Events:
        select.select([self.server.fileno()], [], [], max(0.0, timeout_s))
        got = self.server.drain()
        self.received += len(got)
        for msg in got:
            if msg.get("lr") == self.silent:
                self.silent_last_ts = float(msg["ts"])
        now = time.monotonic()
        if self.cpu0 is None and now - self.started >= self.period_s * 1.5:
            self.cpu0 = (time.process_time(), now)
        return Events(heartbeats=got)

    def kill(self, local_ranks: list[int], sig: int) -> None:
        self.kill_ts = time.time()
        self.cpu1 = (time.process_time(), time.monotonic())
        self.killed = list(local_ranks)

    def stop(self, grace_s: float) -> list[WorkerExit]:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=30)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            self.sent = json.loads(lines[-1])["sent"] if lines else 0
            self.proc = None
        now = time.time()
        return [
            WorkerExit(local_rank=lr, rank=lr, pid=PID_BASE + lr, exit_code=None, signum=9, ts=now)
            for lr in range(self.n)
        ]

    def running(self) -> list[int]:
        return []

    def all_succeeded(self) -> bool:
        return False

    def pending_signal(self) -> int | None:
        return None

    def state_of(self, local_rank: int) -> str | None:
        return "S"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.server.close()


def measure(n: int, *, period_s: float = 1.0, timeout_s: float = 3.0) -> dict[str, Any]:
    """One agent, ``n`` stand-in ranks; rank n // 2 falls silent after two periods."""
    silent = n // 2
    workers = _StandInWorkers(n, period_s=period_s, silent=silent, silent_after_s=2 * period_s)
    spec = largs.JobSpec(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        rdzv_endpoint="127.0.0.1:0",
        rdzv_id="scale",
        entry=largs.Entrypoint(kind="script", target="stand-in"),
        monitor_interval_s=0.1,
    )
    cfg = LauncherConfig(
        heartbeat_interval_s=period_s / 2,
        steady_timeout_s=timeout_s,
        initial_timeout_s=timeout_s * 3,
        stop_grace_s=0.0,
    )
    tracker = HeartbeatTracker(
        enabled=True,
        initial_timeout_s=cfg.initial_timeout_s,
        steady_timeout_s=cfg.steady_timeout_s,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
    )
    quiet = logging.getLogger("unbroken.launcher")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the agent reports the hang it was made to find
    try:
        with tempfile.TemporaryDirectory(prefix="unbroken-scale-hb-") as tmp:
            agent = Agent(
                spec=spec,
                cfg=cfg,
                rdzv=_Rdzv(n),
                workers=workers,
                tracker=tracker,
                run_dir=Path(tmp),
                run_id="scale",
            )
            agent.run()
    finally:
        quiet.setLevel(level)
        workers.close()
    if workers.kill_ts is None or workers.silent_last_ts is None:
        raise RuntimeError(f"the agent did not detect the silent rank among {n}")
    assert workers.cpu0 is not None and workers.cpu1 is not None
    latency = workers.kill_ts - workers.silent_last_ts
    return {
        "ranks": n,
        "detected_ranks": workers.killed,
        "detected_right_rank": workers.killed[:1] == [silent],
        "detection_latency_s": latency,
        "overshoot_s": latency - timeout_s,
        "steady_timeout_s": timeout_s,
        "agent_cpu_s_per_s": (workers.cpu1[0] - workers.cpu0[0])
        / max(1e-9, workers.cpu1[1] - workers.cpu0[1]),
        "received": workers.received,
        "sent": workers.sent,
    }
