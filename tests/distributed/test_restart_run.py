"""``unbroken.restart.run`` on one rank inside the test process (a real gloo group of one):
exceptions and hangs restart ``fn``; swallowed interrupts, raising finally blocks and
``__del__`` do not wedge it; limits escalate; nothing is left behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from procs import one_rank, worker_env
from unbroken.errors import Preempted
from unbroken.ledger import Ledger, read_events
from unbroken.restart import (
    Escalated,
    FaultCountCheck,
    RestartConfig,
    RestartContext,
    RestartInterrupt,
    run,
)
from unbroken.restart.store import StoreHost, spawn_server
from unbroken.workload.model import build_model, get_config
from unbroken.workload.parallel import wrap_model

ENV = one_rank("inproc")


def config(store_addr: str, **fields) -> RestartConfig:
    base = dict(
        store_addr=store_addr,
        monitor_interval_s=0.01,
        soft_timeout_s=0.4,
        hard_timeout_s=10.0,
        initial_soft_timeout_s=10.0,
        initial_hard_timeout_s=20.0,
        exit_timeout_s=5.0,
        barrier_timeout_s=20.0,
        backstop_margin_s=None,  # never arm faulthandler's exit inside pytest
        health_checks=(),
    )
    base.update(fields)
    return RestartConfig(**base)


def _spin() -> None:
    while True:
        time.sleep(0.002)


def test_an_exception_restarts_fn_with_its_cause(store_addr: str, tmp_path: Path) -> None:
    seen = []

    def fn(ctx: RestartContext) -> str:
        seen.append((ctx.iteration, ctx.cause, ctx.rank, ctx.world_size, dist.get_world_size()))
        t = torch.ones(2)
        dist.all_reduce(t)
        ctx.step_done(0)
        if ctx.iteration == 0:
            raise RuntimeError("boom")
        return "done"

    ledger = Ledger(tmp_path, run="inproc", rank=0)
    try:
        assert run(fn, config=config(store_addr), ledger=ledger, env=ENV) == "done"
    finally:
        ledger.close()
    assert [s[0] for s in seen] == [0, 1]
    cause = seen[1][1]
    assert (cause.kind, cause.rank, cause.iteration) == ("exception", 0, 0)
    assert "RuntimeError: boom" in cause.message
    assert seen[1][2:] == (0, 1, 1)
    assert not dist.is_initialized()
    kinds = [(e.kind, e.iteration) for e in read_events(tmp_path)]
    for expected in [("fault_detected", 0), ("restart_begin", 0), ("restart_end", 1)]:
        assert expected in kinds
    assert sum(1 for k in kinds if k == ("phase", 1)) == 1  # pg_init of the new iteration


def test_a_stop_asked_for_during_a_fault_ends_run_instead_of_a_restart(store_addr: str) -> None:
    """The launcher stopping its workers after another one died: the rank unwound from its
    fault (its rescue ran in fn's unwinding) and must not wait for peers that are going too."""
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        raise RuntimeError("the peer is gone")

    with pytest.raises(Preempted) as stopped:
        run(fn, config=config(store_addr), env=ENV, stopping=lambda: True)
    assert calls == [0] and stopped.value.unwound and not dist.is_initialized()
    asked = []
    with pytest.raises(Preempted):  # asked once fn failed, not before
        run(fn, config=config(store_addr), env=ENV, stopping=lambda: asked.append(1) or True)
    assert asked == [1]


def test_a_python_hang_is_detected_and_interrupted(store_addr: str) -> None:
    causes = []

    def fn(ctx: RestartContext) -> int:
        causes.append(ctx.cause)
        ctx.step_done(0)
        if ctx.iteration == 0:
            _spin()
        return ctx.iteration

    assert run(fn, config=config(store_addr), env=ENV) == 1
    assert causes[1].kind == "hang"


def test_a_main_thread_stuck_in_native_code_is_classified_stuck(store_addr: str) -> None:
    causes = []

    def fn(ctx: RestartContext) -> None:
        causes.append(ctx.cause)
        ctx.step_done(0)
        if ctx.iteration == 0:
            time.sleep(1.5)  # native; the interrupt fires when it returns
            _spin()

    run(fn, config=config(store_addr), env=ENV)
    assert causes[1].kind == "stuck"


def test_swallowing_finally_and_del_do_not_wedge_the_restart(
    store_addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "unraisablehook", id)  # see test_restart_interrupt
    log = []

    class Slow:
        def __del__(self) -> None:
            try:
                time.sleep(0.05)
            except BaseException:
                log.append("del")
                raise

    def fn(ctx: RestartContext) -> None:
        ctx.step_done(0)
        if ctx.iteration == 0:  # swallows its first two interrupts
            caught = 0
            while caught < 2:
                try:
                    time.sleep(0.002)
                except RestartInterrupt:
                    caught += 1
                    log.append("swallowed")
            _spin()
        if ctx.iteration == 1:  # the interrupt lands in a finally that raises
            try:
                _spin()
            finally:
                log.append("finally")
                raise ValueError("cleanup failed")  # noqa: B012
        if ctx.iteration == 2:  # interrupts land in __del__, where Python ignores them
            while log.count("del") < 2:
                obj = Slow()
                del obj
            _spin()

    cfg = config(store_addr, max_restore_point_faults=5, max_rank_faults=5)
    run(fn, config=cfg, env=ENV)
    assert log == ["swallowed", "swallowed", "finally", "del", "del"]


def test_the_watchdog_fires_while_the_store_is_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hang checks never wait on message traffic: with the store process stopped (SIGSTOP),
    the local watchdog still interrupts fn; the restart then proceeds once the store is back."""
    monkeypatch.setattr(os, "environ", worker_env())
    proc, port = spawn_server(timeout_s=60)
    host = StoreHost("127.0.0.1", port, server=proc)
    frozen_when_interrupted = []

    def fn(ctx: RestartContext) -> None:
        ctx.step_done(0)
        if ctx.iteration == 0:
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                _spin()
            except RestartInterrupt:
                frozen_when_interrupted.append(_stopped(proc.pid))
                os.kill(proc.pid, signal.SIGCONT)
                raise

    try:
        run(fn, config=config(f"127.0.0.1:{port}"), env=ENV)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        host.close()
    assert frozen_when_interrupted == [True]


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_no_hang_protection_covers_a_long_region(store_addr: str) -> None:
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        ctx.step_done(0)
        with ctx.no_hang_protection():
            time.sleep(1.0)  # 2.5 soft timeouts
        ctx.step_done(1)

    run(fn, config=config(store_addr), env=ENV)
    assert calls == [0]


def test_repeated_failure_escalates(store_addr: str, tmp_path: Path) -> None:
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        ctx.step_done(ctx.iteration)  # a new restore point each time
        raise RuntimeError("always")

    ledger = Ledger(tmp_path, run="inproc", rank=0)
    try:
        with pytest.raises(Escalated, match="rank 0 caused 2 faults") as info:
            run(fn, config=config(store_addr, max_rank_faults=2), ledger=ledger, env=ENV)
    finally:
        ledger.close()
    assert info.value.exit_code == 75 and calls == [0, 1]
    escalations = [e for e in read_events(tmp_path) if e.kind == "escalate"]
    assert len(escalations) == 1 and "max_rank_faults" in escalations[0].get("reason")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"max_iterations": 2}, "max_iterations=2"),
        ({"max_restore_point_faults": 2}, "from restore point 0"),
        ({"health_checks": (FaultCountCheck(1),)}, "min_world_size"),
    ],
)
def test_other_limits_escalate(store_addr: str, fields: dict, match: str) -> None:
    def fn(ctx: RestartContext) -> None:
        ctx.step_done(0)
        raise RuntimeError("always")

    with pytest.raises(Escalated, match=match):
        run(fn, config=config(store_addr, **fields), env=ENV)


def test_run_refuses_an_existing_process_group(store_addr: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="forms the default process group"):
            run(lambda ctx: None, config=config(store_addr), env=ENV)
    finally:
        dist.destroy_process_group()


def test_restarts_free_what_fn_built(store_addr: str) -> None:
    """An FSDP model and its group live in reference cycles: every restart must collect them,
    or their sockets (and, on a GPU, their memory) pile up."""
    fds = []

    def fn(ctx: RestartContext) -> None:
        model = wrap_model(build_model(get_config("tiny"), seed=0), parallel="fsdp", device="cpu")
        model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        ctx.step_done(0)
        fds.append(len(os.listdir("/proc/self/fd")))
        if ctx.iteration < 5:
            raise RuntimeError("again")

    run(fn, config=config(store_addr, max_rank_faults=9, max_restore_point_faults=9), env=ENV)
    assert fds[-1] <= fds[1], fds


def test_run_leaves_no_threads(store_addr: str) -> None:
    before = set(threading.enumerate())
    run(lambda ctx: ctx.step_done(0), config=config(store_addr), env=ENV)
    assert [t.name for t in set(threading.enumerate()) - before] == []


def test_a_worker_held_by_its_agent_leaves_fn_and_takes_the_next_rounds_environment(
    store_addr: str, tmp_path: Path
) -> None:
    """Another node lost: the agent holds this worker (``restart.handover``). ``fn``, blocked in
    a loop, is interrupted as for a peer's fault, no fault of its own recorded; once the agent
    writes the next round, ``run`` raises ``NewRound`` with it; no thread is left."""
    import json
    from datetime import timedelta

    from unbroken.restart.handover import NewRound

    prefix = "unbroken/job/handover/r0/0/"
    env = dataclasses.replace(ENV, handover=prefix)
    host, port = store_addr.rsplit(":", 1)
    agent = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        dist.all_reduce(torch.ones(2))
        ctx.step_done(0)
        agent.wait([prefix + "ready"])
        agent.set(prefix + "hold", json.dumps({"why": "node b left"}))
        _spin()

    def answer() -> None:
        agent_thread = dist.TCPStore(host, int(port), is_master=False)
        agent_thread.wait([prefix + "hold"])
        time.sleep(0.2)  # the round forms meanwhile
        agent_thread.set(prefix + "next", json.dumps({"env": {"RANK": "0"}, "unset": []}))

    before = set(threading.enumerate())
    answering = threading.Thread(target=answer)
    answering.start()
    ledger = Ledger(tmp_path, run="inproc", rank=0)
    try:
        with pytest.raises(NewRound) as new:
            run(fn, config=config(store_addr), ledger=ledger, env=env)
    finally:
        ledger.close()
        answering.join(10)
    assert new.value.env == {"RANK": "0"} and calls == [0] and not dist.is_initialized()
    events = read_events(tmp_path)
    assert not [e for e in events if e.kind == "fault_detected"]
    [begin] = [e for e in events if e.kind == "restart_begin"]
    assert (begin.get("layer"), begin.get("cause")) == ("launcher", "handover")
    assert begin.get("why") == "node b left"
    assert [t.name for t in set(threading.enumerate()) - before] == []
