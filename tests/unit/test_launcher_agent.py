"""The agent driven end to end by a scripted monitor: fake rendezvous, fake workers, fake clock."""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from unbroken.launcher import args as largs
from unbroken.launcher import errors
from unbroken.launcher.agent import RESCUE_GRACE_MIN_S, Agent
from unbroken.launcher.config import LauncherConfig
from unbroken.launcher.machine import State
from unbroken.launcher.monitor import HeartbeatTracker
from unbroken.launcher.rendezvous import JobOver, RoundInfo
from unbroken.launcher.signals import AgentSignal
from unbroken.launcher.workers import Events, WorkerExit
from unbroken.ledger import NullRecorder

NPROC = 2


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeRdzv:
    rounds: list[Any] = field(default_factory=list)  # RoundInfo or an exception to raise
    waiting: list[int] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    lost: list[list[str]] = field(default_factory=list)  # membership's lost nodes, in order

    def next_round(self) -> RoundInfo:
        self.calls.append("next_round")
        item = self.rounds.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    preempted: list[bool] = field(default_factory=list)  # peer_preempted's answers, in order

    def membership(self) -> tuple[int, list[str]]:
        return (self.waiting.pop(0) if self.waiting else 0), (self.lost.pop(0) if self.lost else [])

    def announce_preemption(self, info: RoundInfo) -> None:
        self.calls.append(f"preempted{info.round}")

    def peer_preempted(self, round_: int) -> bool:
        return self.preempted.pop(0) if self.preempted else False

    def exit_barrier(self, info: RoundInfo) -> None:
        self.calls.append(f"barrier{info.round}")

    def leave(self) -> None:
        self.calls.append("leave")

    def close(self) -> None:
        self.calls.append("close")


class FakeWorkers:
    """Per round, a script of what each wait() returns; "tick" lets the timeout pass."""

    warm = True
    standby = 0

    def __init__(self, clock: Clock, script: list[list[Any]]) -> None:
        self.clock = clock
        self.script = script
        self.round_script: list[Any] = []
        self.alive: set[int] = set()
        self.exits: dict[int, WorkerExit] = {}
        self.log: list[tuple[Any, ...]] = []
        self.states: dict[int, str] = {}
        self.pending: list[int] = []
        self.pending_after_stop: list[int] = []

    def interruptible(self, on: bool) -> None:
        pass

    def start(self, info: RoundInfo) -> dict[int, tuple[int, int]]:
        self.log.append(("start", info.round))
        self.round_script = list(self.script.pop(0))
        self.alive, self.exits = set(range(NPROC)), {}
        return {lr: (info.rank_offset + lr, 100 + lr) for lr in range(NPROC)}

    def _exit(self, lr: int, *, code: int | None = 0, sig: int | None = None) -> WorkerExit:
        self.alive.discard(lr)
        x = WorkerExit(
            local_rank=lr, rank=lr, pid=100 + lr, exit_code=code, signum=sig, ts=self.clock.t
        )
        self.exits[lr] = x
        return x

    def wait(self, timeout_s: float) -> Events:
        item = self.round_script.pop(0) if self.round_script else "tick"
        if item == "tick":
            self.clock.t += timeout_s
            return Events()
        self.clock.t += 0.001
        exits = [self._exit(lr, code=code, sig=sig) for lr, code, sig in item.get("exits", [])]
        return Events(
            exits=exits, heartbeats=item.get("heartbeats", []), signals=item.get("signals", [])
        )

    def kill(self, local_ranks: list[int], sig: int) -> None:
        self.log.append(("kill", tuple(local_ranks), sig))

    def stop(self, grace_s: float) -> list[WorkerExit]:
        self.log.append(("stop", grace_s))
        self.pending += self.pending_after_stop
        return [self._exit(lr, code=None, sig=signal.SIGTERM) for lr in sorted(self.alive)]

    def running(self) -> list[int]:
        return sorted(self.alive)

    def all_succeeded(self) -> bool:
        return not self.alive and all(x.ok for x in self.exits.values())

    def state_of(self, local_rank: int) -> str | None:
        return self.states.get(local_rank, "S")

    def pending_signal(self) -> int | None:
        return self.pending.pop(0) if self.pending else None


class FakeLedger(NullRecorder):
    def __init__(self) -> None:
        self.attempt = 0
        self.records: list[tuple[str, dict[str, Any]]] = []

    def set_context(
        self, *, rank: int | None = None, attempt: int | None = None, iteration: int | None = None
    ) -> None:
        if attempt is not None:
            self.attempt = attempt

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> None:
        self.records.append((kind, {"attempt": self.attempt, **data}))

    def interval(self, kind: str, *, begin: float, end: float | None = None, **data: Any) -> None:
        self.emit(kind, **data)

    def kinds(self) -> list[str]:
        return [k if k != "phase" else f"phase:{d['name']}" for k, d in self.records]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.records if k == kind]


def info(round_: int) -> RoundInfo:
    return RoundInfo(
        round=round_,
        group_rank=0,
        group_world_size=1,
        rank_offset=0,
        world_size=NPROC,
        master_addr="127.0.0.1",
        master_port=1,
        store_addr="x:1",
    )


def ok_exits() -> dict[str, Any]:
    return {"exits": [(0, 0, None), (1, 0, None)]}


def hbs(step: int, round_: int = 0) -> dict[str, Any]:
    return {
        "heartbeats": [
            {"lr": lr, "round": round_, "pid": 100 + lr, "step": step} for lr in range(NPROC)
        ]
    }


def make(
    tmp_path: Path,
    script: list[list[Any]],
    *,
    rounds: list[Any],
    max_restarts: int = 3,
    max_nodes: int = 1,
    waiting: list[int] | None = None,
    handover: Any = None,
    **cfg: Any,
) -> tuple[Agent, FakeRdzv, FakeWorkers, FakeLedger]:
    clock = Clock()
    spec = largs.JobSpec(
        min_nodes=1,
        max_nodes=max_nodes,
        nproc_per_node=NPROC,
        rdzv_endpoint="127.0.0.1:0",
        rdzv_id="job",
        max_restarts=max_restarts,
        entry=largs.Entrypoint(kind="script", target="t.py"),
    )
    config = LauncherConfig(
        **{
            "steady_timeout_s": 2.0,
            "initial_timeout_s": 5.0,
            "heartbeat_interval_s": 0.1,
            "stop_grace_s": 1.5,
            **cfg,
        }
    )
    tracker = HeartbeatTracker(
        enabled=config.hang_detection,
        initial_timeout_s=config.initial_timeout_s,
        steady_timeout_s=config.steady_timeout_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    rdzv = FakeRdzv(rounds=rounds, waiting=waiting or [])
    workers = FakeWorkers(clock, script)
    ledger = FakeLedger()
    agent = Agent(
        spec=spec,
        cfg=config,
        rdzv=rdzv,
        workers=workers,
        tracker=tracker,
        ledger=ledger,
        run_dir=tmp_path,
        run_id="job",
        clock=clock,
        wall=clock,
        handover=handover,
    )
    return agent, rdzv, workers, ledger


def test_clean_run(tmp_path: Path) -> None:
    agent, rdzv, workers, ledger = make(tmp_path, [[hbs(0), "tick", ok_exits()]], rounds=[info(0)])
    assert agent.run() == errors.EXIT_OK
    assert agent.machine.history[-1] is State.SUCCEEDED
    assert ledger.kinds() == [
        "phase:rendezvous",
        "phase:launch",
        "worker_exit",
        "worker_exit",
        "job_end",
    ]
    assert rdzv.calls == ["next_round", "barrier0", "close"]
    assert not (tmp_path / "error.json").exists()


def test_worker_killed_then_restarted(tmp_path: Path) -> None:
    script = [[hbs(0), {"exits": [(1, None, signal.SIGKILL)]}], [hbs(0, round_=1), ok_exits()]]
    agent, rdzv, workers, ledger = make(tmp_path, script, rounds=[info(0), info(1)])
    assert agent.run() == errors.EXIT_OK
    (detected,) = ledger.of("fault_detected")
    assert (detected["cause"], detected["detector"], detected["layer"]) == (
        "sigkill",
        "exit",
        "launcher",
    )
    assert (detected["fault_rank"], detected["signal"], detected["attempt"]) == (1, "SIGKILL", 0)
    kinds = ledger.kinds()
    assert (
        kinds.index("fault_detected")
        < kinds.index("restart_begin")
        < kinds.index("phase:stop")
        < kinds.index("restart_end")
    )
    assert ledger.of("restart_end")[0]["attempt"] == 1
    # Adopted workers (they heartbeat) stopped after a worker died get the rescue grace (no
    # step seen yet: its least), time to snapshot the step they noted, not a preemption save.
    assert workers.log == [("start", 0), ("stop", RESCUE_GRACE_MIN_S), ("start", 1)]
    assert agent.machine.restarts == 1


def test_a_script_that_never_heartbeats_keeps_its_sigterm_grace_on_a_restart(
    tmp_path: Path,
) -> None:
    """Not adopted: it may handle SIGTERM itself, as under torchrun."""
    script = [[{"exits": [(1, None, signal.SIGKILL)]}], [ok_exits()]]
    agent, _, workers, _ = make(tmp_path, script, rounds=[info(0), info(1)])
    assert agent.run() == errors.EXIT_OK
    assert workers.log == [("start", 0), ("stop", 1.5), ("start", 1)]


def test_hung_workers_get_sigkill_before_the_group_is_stopped(tmp_path: Path) -> None:
    script = [[hbs(0), hbs(1)], [ok_exits()]]  # then silence: the steady timeout passes
    agent, _, workers, ledger = make(tmp_path, script, rounds=[info(0), info(1)])
    workers.states = {1: "T"}  # rank 1 is stopped: the culprit, whoever was silent longer
    assert agent.run() == errors.EXIT_OK
    (detected,) = ledger.of("fault_detected")
    assert (detected["cause"], detected["detector"], detected["fault_rank"]) == (
        "hang",
        "heartbeat",
        1,
    )
    assert detected["also_ranks"] == [0] and "stopped" in detected["message"]
    assert workers.log[1] == ("kill", (0, 1), signal.SIGKILL)
    assert workers.log[2] == ("stop", 0.0)  # after a hang no rescue grace: nobody unwinds


def test_the_rescue_grace_is_two_of_the_slowest_steps_up_to_the_stop_grace(
    tmp_path: Path,
) -> None:
    script = [[hbs(0), {"exits": [(1, None, signal.SIGKILL)]}], [hbs(0, round_=1), ok_exits()]]
    agent, _, workers, _ = make(tmp_path, script, rounds=[info(0), info(1)])
    agent.tracker.observed.steady_gap_max_s = 0.4
    assert agent.run() == errors.EXIT_OK
    assert workers.log[1] == ("stop", 0.8)
    script = [[hbs(0), {"exits": [(1, None, signal.SIGKILL)]}], [hbs(0, round_=1), ok_exits()]]
    agent, _, workers, _ = make(tmp_path / "slow", script, rounds=[info(0), info(1)])
    agent.tracker.observed.steady_gap_max_s = 5.0
    assert agent.run() == errors.EXIT_OK
    assert workers.log[1] == ("stop", 1.5)  # --ft-stop-grace-s bounds it


def test_budget_exhaustion_writes_the_error_file(tmp_path: Path) -> None:
    crash = {"exits": [(0, 3, None)]}
    agent, rdzv, _, ledger = make(
        tmp_path, [[crash], [crash]], rounds=[info(0), info(1)], max_restarts=1
    )
    assert agent.run() == errors.EXIT_BUDGET_EXHAUSTED
    rec = json.loads((tmp_path / "error.json").read_text())
    assert (rec["rank"], rec["cause"], rec["category"], rec["exit_code"], rec["round"]) == (
        0,
        "exit_code",
        "user",
        3,
        1,
    )
    assert rec["reason"] == "restart_budget_exhausted"
    (end,) = ledger.of("job_end")
    assert (end["status"], end["exit_code"], end["cause"]) == ("failed", 3, "exit_code")
    assert rdzv.calls[-1] == "close"


def test_rendezvous_failure(tmp_path: Path) -> None:
    agent, _, _, _ = make(tmp_path, [], rounds=[TimeoutError("no quorum")])
    assert agent.run() == errors.EXIT_RENDEZVOUS_FAILED
    rec = json.loads((tmp_path / "error.json").read_text())
    assert (rec["cause"], rec["category"], rec["rank"]) == ("rendezvous", "infra", -1)
    assert "no quorum" in rec["message"]


def test_a_node_whose_own_rendezvous_failed_leaves_the_job_open_for_the_others(
    tmp_path: Path,
) -> None:
    """Closing is for failures every node shares: a node that could not join (exit 5) only
    leaves; a replacement takes its place and the job goes on."""
    agent, rdzv, _, _ = make(tmp_path, [], rounds=[TimeoutError("no quorum")], max_nodes=3)
    assert agent.run() == errors.EXIT_RENDEZVOUS_FAILED
    assert rdzv.calls == ["next_round", "leave"]


def test_a_spare_that_finds_the_job_over_exits_0_without_workers(tmp_path: Path) -> None:
    agent, rdzv, workers, ledger = make(
        tmp_path, [], rounds=[JobOver("the rendezvous 'job' is closed")], max_nodes=4
    )
    assert agent.run() == errors.EXIT_OK
    assert workers.log == [] and not (tmp_path / "error.json").exists()
    assert rdzv.calls == ["next_round", "close"]  # no exit barrier: it never joined a round
    (end,) = ledger.of("job_end")
    assert (end["status"], end["exit_code"]) == ("ok", 0)
    assert agent.machine.history == [State.INIT, State.RENDEZVOUS, State.SUCCEEDED]


def test_membership_change_restarts_without_using_the_budget(tmp_path: Path) -> None:
    agent, _, workers, ledger = make(
        tmp_path,
        [[hbs(0), "tick"], [ok_exits()]],
        rounds=[info(0), info(1)],
        max_restarts=0,
        max_nodes=2,
        waiting=[0, 1],
    )
    assert agent.run() == errors.EXIT_OK
    assert not ledger.of("fault_detected")
    assert ledger.of("restart_begin")[0]["cause"] == "membership"
    assert agent.machine.restarts == 0 and workers.log[-1] == ("start", 1)


def test_signal_to_the_agent_stops_workers_and_exits_128_plus_n(tmp_path: Path) -> None:
    agent, _, workers, _ = make(
        tmp_path, [[hbs(0), {"signals": [signal.SIGTERM]}]], rounds=[info(0)]
    )
    assert agent.run() == 128 + signal.SIGTERM
    assert workers.log[-1] == ("stop", 1.5)
    assert json.loads((tmp_path / "error.json").read_text())["cause"] == "agent_sigterm"


def _multi_node(round_: int) -> RoundInfo:
    return dataclasses.replace(info(round_), group_world_size=2, world_size=2 * NPROC)


def test_a_sigterm_in_a_multi_node_job_is_told_to_the_others_and_leaves_the_rendezvous_open(
    tmp_path: Path,
) -> None:
    """Its pod evicted: the other nodes hear of the preemption (they save with it), and this
    node leaves the rendezvous; closing it would end the job for every node."""
    agent, rdzv, workers, _ = make(
        tmp_path,
        [[hbs(0), {"signals": [signal.SIGTERM]}]],
        rounds=[_multi_node(0)],
        max_nodes=2,
        membership_check_s=1e-6,
    )
    assert agent.run() == 128 + signal.SIGTERM
    assert rdzv.calls == ["next_round", "preempted0", "leave", "leave"]  # at once, and at exit
    assert workers.log[-1] == ("stop", 1.5)  # the workers' grace: they save the agreed step


class FakeHandover:
    """``launcher.handover.Handover``'s answers, scripted: whether it pauses, and whether the
    paused workers can be handed over."""

    def __init__(self, *, pauses: bool, hands_over: bool) -> None:
        self.pauses, self.hands_over = pauses, hands_over
        self.paused: list[str] = []
        self.calls: list[tuple[Any, ...]] = []

    def pause(self, info: RoundInfo, failures: list[Any]) -> bool:
        self.calls.append(("pause", info.round, tuple(f.cause for f in failures)))
        self.paused = ["p0/", "p1/"] if self.pauses else []
        return self.pauses

    def hand_over(self, info: RoundInfo) -> tuple[dict[int, tuple[int, int]] | None, list[Any]]:
        self.calls.append(("hand_over", info.round))
        self.paused = []
        if not self.hands_over:
            return None, []
        return {lr: (info.rank_offset + lr, 100 + lr) for lr in range(NPROC)}, []

    def refuse(self, why: str) -> None:
        self.calls.append(("refuse", why))
        self.paused = []


@pytest.mark.parametrize("hands_over", [True, False])
def test_after_a_lost_node_the_workers_are_paused_then_handed_over_to_the_next_round(
    tmp_path: Path, hands_over: bool
) -> None:
    """A lost node: this node's workers are paused, not stopped; once the next round has
    formed they are its workers, the same processes (no start). When they cannot be handed
    over (one exited meanwhile), they are stopped and new ones started."""
    handover = FakeHandover(pauses=True, hands_over=hands_over)
    script = [[hbs(0), "tick", ok_exits()]] + ([] if hands_over else [[ok_exits()]])
    agent, _, workers, ledger = make(
        tmp_path,
        script,
        rounds=[_multi_node(0), _multi_node(1)],
        max_nodes=2,
        membership_check_s=1e-6,
        handover=handover,
    )
    agent.rdzv.lost = [["node-b"]]  # type: ignore[attr-defined]
    assert agent.run() == errors.EXIT_OK
    assert handover.calls[:2] == [("pause", 0, ("node_lost",)), ("hand_over", 1)]
    assert ledger.of("fault_detected")[0]["cause"] == "node_lost"
    [end] = ledger.of("restart_end")
    if hands_over:
        assert workers.log == [("start", 0)]  # never stopped, never started again
        assert end["handover"] is True
        assert [p["paused"] for p in ledger.of("phase") if p.get("name") == "stop"] == [True]
    else:
        assert workers.log == [("start", 0), ("stop", 1.5), ("start", 1)]
        assert "handover" not in end


def test_another_nodes_preemption_saves_with_it_then_goes_on_without_the_budget(
    tmp_path: Path,
) -> None:
    """Another node announced its preemption: this node's workers get the grace to save the
    step every rank agrees on (SIGTERM), then the next round starts; no restart is counted."""
    script = [[hbs(0), "tick"], [hbs(0, round_=1), ok_exits()]]
    agent, rdzv, workers, ledger = make(
        tmp_path,
        script,
        rounds=[_multi_node(0), _multi_node(1)],
        max_nodes=2,
        max_restarts=0,
        membership_check_s=1e-6,
    )
    rdzv.preempted = [False, True]
    assert agent.run() == errors.EXIT_OK
    assert ("stop", 1.5) in workers.log and workers.log[-1] == ("start", 1)
    assert [d["cause"] for d in ledger.of("restart_begin")] == ["preemption"]
    assert not ledger.of("fault_detected") and agent.machine.restarts == 0
    assert rdzv.calls == ["next_round", "next_round", "barrier1", "close"]


def test_signal_while_stopping_prevents_the_next_round(tmp_path: Path) -> None:
    script = [[{"exits": [(1, None, signal.SIGKILL)]}]]
    agent, rdzv, workers, _ = make(tmp_path, script, rounds=[info(0), info(1)])
    workers.pending_after_stop = [signal.SIGTERM]
    assert agent.run() == 128 + signal.SIGTERM
    assert rdzv.calls == ["next_round", "close"] and workers.log[0] == ("start", 0)
    assert ("start", 1) not in workers.log


def test_signal_during_rendezvous(tmp_path: Path) -> None:
    agent, _, workers, _ = make(tmp_path, [], rounds=[AgentSignal(signal.SIGINT)])
    assert agent.run() == 128 + signal.SIGINT
    assert workers.log == [("stop", 1.5)]


@pytest.mark.parametrize("hang_detection", [True, False])
def test_a_job_that_never_heartbeats_is_not_killed(tmp_path: Path, hang_detection: bool) -> None:
    script = [["tick"] * 200 + [ok_exits()]]  # 200 monitor intervals of silence
    agent, _, _, ledger = make(tmp_path, script, rounds=[info(0)], hang_detection=hang_detection)
    assert agent.run() == errors.EXIT_OK
    assert not ledger.of("fault_detected")
