"""Graceful preemption: SIGTERM to ``unbroken-run`` mid-run, then a relaunch that resumes.

Every rank saves the step they agreed to stop at (``unbroken.checkpoint.preempt``), the
launcher exits 143 (128 + SIGTERM), the relaunch restores that step and trains no step twice,
and the final weights equal a run that was never stopped, bit for bit."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from once import once
from procs import popen, run, unbroken_run_cmd
from unbroken.checkpoint import layout
from unbroken.ledger import goodput, read_events

STEPS = 60
ARGS = ["--batch-size", "4", "--ckpt-every", "1000"]  # no periodic save before the stop
TIMEOUT_S = 240


def _cmd(run_dir: Path, *launcher_args: str, extra: tuple[str, ...] = ()) -> list[str]:
    return unbroken_run_cmd(
        run_dir, nproc=2, steps=STEPS, extra=[*ARGS, *extra], launcher_args=list(launcher_args)
    )


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    def compute() -> str:
        res = run(_cmd(tmp_path_factory.mktemp("reference")), timeout_s=TIMEOUT_S)
        assert res.returncode == 0 and len(set(res.hashes())) == 1, res.output[-3000:]
        return res.hashes()[0]

    return once(request, compute)


def _steps(events: list) -> list[int]:
    return sorted({int(e.get("step")) for e in events if e.kind == "step" and e.rank == 0})


def _live_steps(run_dir: Path) -> list[int]:
    try:
        return _steps(read_events(run_dir))
    except FileNotFoundError:  # no ledger yet
        return []


def test_sigterm_saves_the_agreed_step_and_the_relaunch_trains_no_step_twice(
    reference: str, tmp_path: Path
) -> None:
    proc = popen(_cmd(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not [s for s in _live_steps(tmp_path) if s >= 10]:
            assert proc.poll() is None, "the run ended before it was stopped"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # as Kubernetes stops a pod
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    ckpt = tmp_path / "ckpt"
    committed = layout.committed_steps(ckpt)
    assert committed, out[-3000:]
    stopped_at = committed[0]
    first = read_events(tmp_path)
    preemptions = [e for e in first if e.kind == "phase" and e.get("name") == "preemption"]
    assert {e.rank for e in preemptions} == {0, 1}, out[-3000:]
    assert {e.get("step") for e in preemptions} == {stopped_at}
    assert all(e.get("durable") for e in preemptions)
    assert max(_steps(first)) < stopped_at  # maybe_save(T) comes before step_done(T) here
    assert not [e for e in first if e.kind in ("fault_detected", "ckpt_fail")]
    report = goodput.compute(first)
    assert report.badput_s["preemption"] > 0 and report.faults == []

    res = run(_cmd(tmp_path, "--ft-resume", extra=("--resume",)), timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]
    events = read_events(tmp_path)
    loads = [e for e in events if e.kind == "ckpt_load" and e.ts > max(x.ts for x in first)]
    assert loads and {e.get("step") for e in loads} == {stopped_at}
    second = [e for e in events if e.kind == "step" and e.rank == 0 and e.ts > loads[0].ts]
    assert min(int(e.get("step")) for e in second) == stopped_at + 1  # 0 steps trained twice
