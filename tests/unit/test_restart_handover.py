"""A worker handed over to the next round: both sides of the protocol over a real TCPStore."""

from __future__ import annotations

import dataclasses
import json
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from unbroken.errors import Preempted
from unbroken.launcher.grouprank import stable_ranks
from unbroken.launcher.handover import NODE_LOST, Handed, Handover
from unbroken.restart.barrier import Interrupted, wait_for
from unbroken.restart.handover import Handover as Listener
from unbroken.restart.handover import NewRound, parse_next

PREFIX = "unbroken/job/handover/r0/2/"
ROUND0 = SimpleNamespace(round=0, rank_offset=2, world_size=6)
ROUND1 = SimpleNamespace(round=1, rank_offset=2, world_size=6)


@pytest.fixture(scope="module")
def _server() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def store(_server: Any, request: pytest.FixtureRequest) -> Any:
    """One store for the module (a new server per test made some first connections wait
    seconds), each test's keys under its own prefix."""
    return SimpleNamespace(port=_server.port, prefix=f"{request.node.name}/")


def _agent_store(store: Any) -> Any:
    """The agent's one connection to the job store, as ``rdzv.job_store`` is."""
    conn = _connect(store)
    return lambda: conn


def _connect(store: Any) -> Any:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(store.prefix, client)


class _Failure:
    def __init__(self, cause: str) -> None:
        self.cause = cause
        self.message = f"{cause}: node ft-0 left the rendezvous"


class _Workers:
    """The worker set of one node: two local ranks, ranks 2-3."""

    def __init__(self, running: list[int], *, still: bool = True) -> None:
        self._running = running
        self.still = still

    def running(self) -> list[int]:
        return self._running

    def handover_prefix(self, info: Any, local_rank: int) -> str:
        return f"unbroken/job/handover/r{info.round}/{info.rank_offset + local_rank}/"

    def hand_over(self, info: Any) -> tuple[dict[int, Handed] | None, list[Any]]:
        if not self.still:
            return None, ["exit"]
        env = {"RANK": "2", "UNBROKEN_ROUND": "1"}
        return {lr: Handed(2 + lr, 100 + lr, env, ["UNBROKEN_PEERS"]) for lr in (0, 1)}, []


def test_a_paused_worker_is_interrupted_then_takes_the_next_rounds_environment(store: Any) -> None:
    both = threading.Barrier(3)
    why: list[str] = []
    listeners = [
        Listener(
            lambda: _connect(store),
            f"unbroken/job/handover/r0/{rank}/",
            on_pause=lambda w: (why.append(w), both.wait(10)),
        )
        for rank in (2, 3)
    ]
    agent = Handover(_agent_store(store), _Workers([0, 1]), nproc=2)
    assert agent.pause(ROUND0, [_Failure(NODE_LOST)])
    both.wait(10)  # each listener called on_pause, from its own thread
    assert why[0].startswith("node_lost: node ft-0") and len(why) == 2
    assert all(x.paused == why[0] for x in listeners)
    handed, exits = agent.hand_over(ROUND1)
    assert handed == {0: (2, 100), 1: (3, 101)} and exits == []
    new = listeners[0].next_round(stopping=lambda: False)
    assert isinstance(new, NewRound)
    assert new.env == {"RANK": "2", "UNBROKEN_ROUND": "1"} and new.unset == ("UNBROKEN_PEERS",)
    for listener in listeners:
        listener.close()


def test_no_pause_unless_every_worker_runs_listens_and_only_nodes_were_lost(store: Any) -> None:
    agent = Handover(_agent_store(store), _Workers([0, 1]), nproc=2)
    assert not agent.pause(ROUND0, [_Failure(NODE_LOST)])  # nobody listens
    listeners = [
        Listener(lambda: _connect(store), f"unbroken/job/handover/r0/{r}/", on_pause=print)
        for r in (2, 3)
    ]
    assert not agent.pause(ROUND0, [_Failure("exit")])  # a worker of ours failed
    assert not agent.pause(ROUND0, [_Failure(NODE_LOST), _Failure("hang")])
    assert not Handover(_agent_store(store), _Workers([1]), nproc=2).pause(
        ROUND0, [_Failure(NODE_LOST)]
    )
    assert agent.paused == [] and all(x.paused is None for x in listeners)
    for listener in listeners:
        listener.close()  # released: does not wait forever


def test_a_worker_that_exited_while_paused_has_the_others_refused(store: Any) -> None:
    listeners = [
        Listener(lambda: _connect(store), f"unbroken/job/handover/r0/{r}/", on_pause=print)
        for r in (2, 3)
    ]
    agent = Handover(_agent_store(store), _Workers([0, 1], still=False), nproc=2)
    assert agent.pause(ROUND0, [_Failure(NODE_LOST)])
    handed, exits = agent.hand_over(ROUND1)
    assert handed is None and exits == ["exit"] and agent.paused == []
    stop = listeners[1].next_round(stopping=lambda: False)
    assert isinstance(stop, Preempted) and stop.unwound
    assert "exited while paused" in str(stop)
    for listener in listeners:
        listener.close()


def test_workers_whose_ranks_moved_are_not_handed_over(store: Any) -> None:
    listeners = [
        Listener(lambda: _connect(store), f"unbroken/job/handover/r0/{r}/", on_pause=print)
        for r in (2, 3)
    ]
    agent = Handover(_agent_store(store), _Workers([0, 1]), nproc=2)
    assert agent.pause(ROUND0, [_Failure(NODE_LOST)])
    moved = SimpleNamespace(round=1, rank_offset=0, world_size=6)
    assert agent.hand_over(moved) == (None, [])
    stop = listeners[0].next_round(stopping=lambda: False)
    assert isinstance(stop, Preempted) and "ranks moved" in str(stop)
    for listener in listeners:
        listener.close()


def test_stable_ranks_keep_a_nodes_place_and_give_the_lost_ones_to_newcomers() -> None:
    assert stable_ranks([1, -1, 2]) == [1, 0, 2]  # the spare takes the lost node 0's place
    assert stable_ranks([-1, -1, -1]) == [0, 1, 2]  # the first round: torch's order
    assert stable_ranks([2, 0, 0, 5]) == [2, 0, 1, 3]  # a clash or a place now out of range


def test_a_paused_worker_asked_to_stop_leaves_without_an_answer(store: Any) -> None:
    listener = Listener(lambda: _connect(store), PREFIX, on_pause=print)
    stop = listener.next_round(stopping=lambda: True)
    assert isinstance(stop, Preempted)
    listener.close()


@pytest.mark.parametrize(
    "raw",
    [b"[]", b'{"env": {"A": 1}}', b'{"env": {"A": "1"}, "unset": "B"}', b'{"unset": []}'],
)
def test_a_malformed_answer_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="handover"):
        parse_next(raw)


def test_an_answer_parses() -> None:
    new = parse_next(json.dumps({"env": {"RANK": "3"}, "unset": ["X"]}).encode())
    assert isinstance(new, NewRound) and new.env == {"RANK": "3"} and new.unset == ("X",)


def test_a_barrier_waiting_for_a_lost_node_is_left_when_interrupted(store: Any) -> None:
    client = _connect(store)
    client.set("k/0", "1")
    asked = []

    def interrupted() -> bool:
        asked.append(1)
        return len(asked) >= 3

    with pytest.raises(Interrupted):
        wait_for(client, ["k/0", "k/1"], [0, 1], timeout_s=60, interrupted=interrupted)
    # Not interrupted: the members there when the time ran out.
    assert wait_for(client, ["k/0", "k/1"], [0, 1], timeout_s=0.3, interrupted=lambda: False) == [0]


def test_the_workers_handed_over_get_every_name_of_the_round_even_one_the_agent_has(
    tmp_path: Path,
) -> None:
    """Real processes of a node (cold starts of ``sleep``): handed over to the next round, each
    keeps its pid and gets the round's whole environment, ``RANK`` included although the
    agent's own environment has the same value (a pod given ``RANK`` by its operator); the
    peers of a round that has none are unset."""
    import signal as signal_
    import sys

    from unbroken.launcher import args as largs
    from unbroken.launcher.config import LauncherConfig
    from unbroken.launcher.monitor import HeartbeatServer
    from unbroken.launcher.rendezvous import RoundInfo
    from unbroken.launcher.signals import SignalPipe
    from unbroken.launcher.workers import LocalWorkers

    spec = largs.JobSpec(
        min_nodes=2,
        max_nodes=3,
        nproc_per_node=2,
        rdzv_endpoint="127.0.0.1:0",
        rdzv_id="job",
        max_restarts=3,
        entry=largs.Entrypoint(
            kind="command", target=sys.executable, args=("-c", "import time; time.sleep(60)")
        ),
    )
    heartbeats, signals = HeartbeatServer(), SignalPipe((signal_.SIGTERM,))
    workers = LocalWorkers(
        spec,
        LauncherConfig(),
        run_dir=tmp_path,
        run_id="job",
        heartbeats=heartbeats,
        signals=signals,
        zygote=None,
        base_env={"PATH": "/usr/bin:/bin", "RANK": "2"},
    )
    first = RoundInfo(
        round=0,
        group_rank=1,
        group_world_size=3,
        rank_offset=2,
        world_size=6,
        master_addr="127.0.0.1",
        master_port=1,
        store_addr="127.0.0.1:2",
        peers=("a:1#t", "b:1#t", "c:1#t"),
    )
    second = dataclasses.replace(first, round=1, master_port=3, peers=())
    try:
        started = workers.start(first)
        handed, exits = workers.hand_over(second)
        assert handed is not None and exits == []
        assert {lr: (h.rank, h.pid) for lr, h in handed.items()} == started
        env = handed[0].env
        assert env["RANK"] == "2" and env["UNBROKEN_ROUND"] == "1" and env["MASTER_PORT"] == "3"
        assert env["UNBROKEN_HANDOVER"] == "unbroken/job/handover/r1/2/"
        assert handed[1].env["RANK"] == "3" and "PATH" not in env
        assert handed[0].unset == ["UNBROKEN_PEERS"]
        assert (tmp_path / "launcher" / "attempt_1" / "3").is_dir()
    finally:
        workers.stop(0.0)
        workers.close()
        heartbeats.close()
        signals.close()
