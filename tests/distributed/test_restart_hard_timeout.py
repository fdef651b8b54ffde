"""A rank that no interrupt can reach is killed, so that the launcher takes over."""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from procs import worker_env
from unbroken.ledger import read_events

WORKER = Path(__file__).resolve().parents[1] / "workers" / "hang_worker.py"


def _run(mode: str, run_dir: Path) -> subprocess.CompletedProcess:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    env = worker_env(
        UNBROKEN_STORE_ADDR=f"127.0.0.1:{store.port}",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
    )
    try:
        return subprocess.run(
            [sys.executable, str(WORKER), mode, str(run_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        del store


def test_stuck_in_native_code_past_the_exit_timeout_is_killed(tmp_path: Path) -> None:
    res = _run("native", tmp_path)
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr
    assert "hanging" in res.stdout and "run returned" not in res.stdout
    events = read_events(tmp_path)
    detected = [e.get("detector") for e in events if e.kind == "fault_detected"]
    assert detected == ["watchdog", "watchdog-hard"]
    escalations = [e for e in events if e.kind == "escalate"]
    assert len(escalations) == 1 and "exit_timeout" in escalations[0].get("reason")


def test_a_main_thread_holding_the_gil_is_ended_by_the_backstop(tmp_path: Path) -> None:
    res = _run("gil", tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Timeout (0:" in res.stderr  # faulthandler's dump of the stuck threads
    assert "run returned" not in res.stdout
