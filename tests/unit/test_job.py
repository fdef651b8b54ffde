"""``unbroken.run``'s plumbing: the active ledger, the heartbeat with the committed step, the
abort of what a failed iteration left open, the default run directory, and ``unbroken.main``'s
exit codes (real Checkpointers with their writer processes; ``main`` in a real process)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from procs import capture, worker_env
from unbroken import job
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.checkpointer import open_checkpointers
from unbroken.env import WorkerEnv
from unbroken.launcher import client
from unbroken.ledger import Ledger, read_events
from unbroken.ledger import events as ev
from unbroken.ledger.active import activate, current
from unbroken.restart import RestartContext


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_a_checkpointer_records_into_the_active_ledger(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "run", run="t", rank=0)
    assert current() is None
    with activate(led):
        assert current() is led
        with Checkpointer(tmp_path / "ckpt") as ck:  # not handed the ledger
            ck.save(0, _state())
    assert current() is None
    with Checkpointer(tmp_path / "other") as ck:  # outside a run: no ledger
        ck.save(0, _state())
    led.close()
    kinds = [e.kind for e in read_events(tmp_path / "run")]
    assert kinds.count(ev.CKPT_STAGE) == 1 and ev.CKPT_COMMIT in kinds


def test_resume_is_the_step_to_continue_from(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.resume(_state()) == 0  # nothing saved yet
        ck.save(6, _state())
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.resume(_state()) == 7


def test_the_heartbeat_carries_the_newest_committed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agent.bind(("127.0.0.1", 0))
    agent.settimeout(10)
    monkeypatch.setenv("UNBROKEN_HEARTBEAT_ADDR", f"127.0.0.1:{agent.getsockname()[1]}")
    client.reset()
    try:
        job._beat(0)
        assert json.loads(agent.recv(4096))["committed"] is None
        with Checkpointer(tmp_path / "ckpt") as ck:
            ck.save(3, _state())
            ck.wait()  # committed
            job._beat(4)
            msg = json.loads(agent.recv(4096))
        assert (msg["step"], msg["committed"]) == (4, 3)
        assert job._committed_step() is None  # closed: no longer reported
    finally:
        client.reset()
        agent.close()


@pytest.mark.slow
def test_a_failed_iteration_aborts_the_checkpointers_it_left_open(tmp_path: Path) -> None:
    older = Checkpointer(tmp_path / "older")
    before = set(open_checkpointers())
    ctx = RestartContext(
        iteration=0,
        cause=None,
        rank=0,
        world_size=1,
        local_rank=0,
        member=0,
        run_dir=tmp_path,
        ledger=None,
        monitor=None,
    )
    seen: list[Any] = []
    ctx.add_exit_hook(seen.append)
    ctx.add_exit_hook(lambda error: 1 / 0)  # logged, and the next hook still runs
    ctx.add_exit_hook(lambda error: job._abort_new(before, error))
    left_open = Checkpointer(tmp_path / "new")
    left_open.save(0, _state())
    writer = left_open.writer_pid
    assert writer is not None
    ctx._exited(None)  # fn returned: nothing is aborted
    assert left_open in open_checkpointers()
    error = RuntimeError("boom")
    ctx._exited(error)
    assert seen == [None, error]
    assert left_open not in open_checkpointers() and older in open_checkpointers()
    older.close()


def test_the_run_directory_every_rank_agrees_on(tmp_path: Path) -> None:
    def env(**e: str) -> WorkerEnv:
        return WorkerEnv.from_environ(e)

    assert job.run_dir_for(env(UNBROKEN_RUN_DIR=str(tmp_path))) == tmp_path  # unbroken-run's
    script = tmp_path / "train.py"
    script.write_text("")
    alone = job.run_dir_for(env(), str(script))  # started by hand
    assert alone is not None and alone.parent == Path("runs")
    assert alone.name.startswith("train-") and alone.name.endswith(f"-{os.getpid()}")
    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "2"}
    assert job.run_dir_for(env(**launched, TORCHELASTIC_RUN_ID="abc")) == Path("runs/abc")
    assert job.run_dir_for(env(**launched, TORCHELASTIC_RUN_ID="none")) is None


def test_the_exceptions_a_user_may_see_are_public_with_their_exit_codes() -> None:
    assert issubclass(unbroken.Escalated, unbroken.UnbrokenError)
    assert issubclass(unbroken.RankExcluded, unbroken.UnbrokenError)
    assert issubclass(unbroken.CheckpointError, unbroken.UnbrokenError)
    assert (unbroken.Escalated.exit_code, unbroken.RankExcluded.exit_code) == (75, 0)


MAIN = """
import unbroken

def train(ctx):
    ctx.step_done(0)
    if {fail}:
        raise RuntimeError("a bug in train")

unbroken.main(train, config=unbroken.RestartConfig(max_iterations=1))
"""


def _lone_process(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script outside any launcher (no launcher environment)."""
    return capture([sys.executable, "-c", code], cwd=cwd, env=_lone_env())


def _lone_env() -> dict[str, str]:
    env = worker_env()
    for name in [k for k in env if k.startswith(("UNBROKEN_", "TORCHELASTIC_", "MASTER_"))]:
        del env[name]
    return env


@pytest.mark.parametrize("fail", [False, True])
@pytest.mark.slow
def test_main_exits_with_the_launchers_code(tmp_path: Path, fail: bool) -> None:
    out = _lone_process(MAIN.format(fail=fail), tmp_path)
    assert out.returncode == (75 if fail else 0), out.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()  # the default run directory of a lone process
    kinds = [e.kind for e in read_events(run_dir)]
    assert ev.PROCESS_START in kinds and ev.STEP in kinds
    if fail:  # one iteration allowed: the fault escalates
        assert ev.ESCALATE in kinds and ev.JOB_END not in kinds
        assert "Escalated" in out.stderr and "exit code 75" in out.stderr
    else:
        assert ev.JOB_END in kinds


PREEMPTED = """
import atexit
import unbroken
from unbroken.errors import Preempted

atexit.register(lambda: print("atexit ran", flush=True))

def train(ctx):
    ctx.step_done(0)
    raise Preempted("preempted: step 0 is committed")

unbroken.main(train, exit_fast={fast})
"""


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.slow
def test_a_preempted_process_exits_143_and_exit_fast_skips_the_teardown(
    tmp_path: Path, fast: bool
) -> None:
    """After a preemption's committed save the process exits 143; with ``exit_fast`` at once
    (no atexit handler, no interpreter teardown), the ledger closed before it."""
    out = _lone_process(PREEMPTED.format(fast=fast), tmp_path)
    assert out.returncode == 143, out.stderr[-3000:]
    assert "exit code 143" in out.stderr
    assert ("atexit ran" in out.stdout) is not fast
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert ev.STEP in [e.kind for e in read_events(run_dir)]


def test_a_bad_unbroken_faults_plan_is_a_clear_error(tmp_path: Path) -> None:
    missing = WorkerEnv.from_environ({"UNBROKEN_FAULTS": str(tmp_path / "nope.yaml")})
    with pytest.raises(ValueError, match="UNBROKEN_FAULTS=.*nope.yaml: no such file"):
        job._injector(dataclasses.replace(missing, run_dir=tmp_path), None)
    with pytest.raises(ValueError, match="needs a run directory"):
        job._injector(missing, None)
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 3, rank: 1, kind: exception}\n")
    env = WorkerEnv.from_environ(
        {"UNBROKEN_FAULTS": str(plan), "UNBROKEN_RUN_DIR": str(tmp_path), "WORLD_SIZE": "2"}
    )
    injector = job._injector(env, None)
    assert injector is not None and [f.kind for f in injector.plan.faults] == ["exception"]


SLOW_CLOSE = """
import torch
import unbroken

def train(ctx):
    torch.manual_seed(0)
    state = {{"model": torch.nn.Linear(256, 256)}}
    # The commit of the last save takes ~1 s (0.25 MB/s), longer than the 0.3 s timeout.
    slow = unbroken.CheckpointConfig(throttle_mbps=0.25)
    ckpt = unbroken.Checkpointer(ctx.run_dir / "ckpt", every_steps=1, config=slow)
    for step in range(3):
        ctx.step_done(step)
    ckpt.save(2, state)
    ckpt.close()

unbroken.main(train, config=unbroken.RestartConfig(soft_timeout_s=0.3, max_iterations=1))
"""


@pytest.mark.slow
def test_a_long_final_commit_is_no_hang(tmp_path: Path) -> None:
    """A user's ``ckpt.close()`` after the loop, as in the README's example, waits for the
    last save's commit longer than the soft timeout: neither the watchdog (a hang would
    escalate: one iteration allowed) nor the launcher (told by a "finishing" heartbeat)
    counts that wait."""
    agent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agent.bind(("127.0.0.1", 0))
    env = _lone_env()
    env["UNBROKEN_HEARTBEAT_ADDR"] = f"127.0.0.1:{agent.getsockname()[1]}"
    try:
        out = capture([sys.executable, "-c", SLOW_CLOSE.format()], cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        agent.setblocking(False)
        beats = []
        while True:
            try:
                beats.append(json.loads(agent.recv(65536)))
            except BlockingIOError:
                break
    finally:
        agent.close()
    (run_dir,) = (tmp_path / "runs").iterdir()
    events = read_events(run_dir)
    kinds = [e.kind for e in events]
    assert ev.FAULT_DETECTED not in kinds and ev.JOB_END in kinds
    commit = next(e for e in events if e.kind == ev.CKPT_COMMIT)
    last_step = max(float(e.ts) for e in events if e.kind == ev.STEP)
    assert float(commit.ts) - last_step > 0.3  # the wait was longer than the timeout
    assert beats[0]["step"] == 0  # a new step is told at most every STEP_GAP_S
    assert beats[-1].get("fin") is True  # then the launcher was told: finishing
    assert beats[-1]["step"] == 2  # with the newest step
