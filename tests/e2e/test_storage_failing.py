"""Failing checkpoint storage is a storage fault, not a training fault: the job trains to the
end, bit-exact, on its memory tier; the failures are recorded and nothing restarts.

Real storage where it runs here: a tmpfs that is full before the first save, one remounted
read-only in the middle of the run. A save stalled past ``persist_timeout_s`` comes from the
fault plan (``storage-fail``, raised at the writer's I/O boundary: emulated).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from once import once
from procs import popen, run, unbroken_run_cmd
from unbroken.checkpoint import layout
from unbroken.ledger import goodput, read_events

STEPS = 64  # a stalled save fails 2 s (persist_timeout_s) after its staging, while
# training goes on at ~0.06 s a step: later due saves must still come after that
ARGS = ["--batch-size", "4", "--ckpt-every", "4", "--storage-retry-s", "0.2"]
TIMEOUT_S = 240


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return unbroken_run_cmd(run_dir, nproc=2, steps=STEPS, extra=[*ARGS, *extra])


def _hashes(res: run) -> list[str]:  # type: ignore[valid-type]
    assert res.returncode == 0, res.output[-3000:]
    assert len(res.hashes()) == 2, res.output[-3000:]
    return res.hashes()


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    def compute() -> str:
        run_dir = tmp_path_factory.mktemp("reference")
        hashes = _hashes(run(_cmd(run_dir), timeout_s=TIMEOUT_S))
        assert len(set(hashes)) == 1
        return hashes[0]

    return once(request, compute)


def _fill(path: Path) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def _no_restart(events: list) -> None:
    assert {e.attempt for e in events} == {0}  # no launcher restart
    kinds = {e.kind for e in events}
    assert not kinds & {"fault_detected", "restart_begin", "restart_end"}, kinds


def test_storage_full_from_the_first_save(
    reference: str, tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    mnt = tmpfs("1m")
    (mnt / "ckpt").mkdir()
    _fill(mnt / "filler")
    res = run(_cmd(tmp_path, "--ckpt-dir", str(mnt / "ckpt")), timeout_s=TIMEOUT_S)
    assert _hashes(res) == [reference, reference]
    events = read_events(tmp_path)
    _no_restart(events)
    fails = [e for e in events if e.kind == "ckpt_fail"]
    assert fails and all("No space left" in e.get("error") for e in fails), fails
    assert not [e for e in events if e.kind == "ckpt_commit"]
    held = [e for e in events if e.kind == "ckpt_skip" and "storage failing" in e.get("reason")]
    assert held  # saves inside the back-off were memory snapshots
    assert layout.committed_steps(mnt / "ckpt") == []
    storage = goodput.compute(events).storage
    assert storage.failing and storage.failed_saves >= 1 and storage.saves_held_back >= 1
    span = max(e.ts for e in events) - min(e.ts for e in fails)
    assert storage.unprotected_s == pytest.approx(span, abs=0.01)  # to the end of the run
    res = run([sys.executable, "-m", "unbroken.cli", "report", str(tmp_path)], timeout_s=60)
    report = res.output
    assert res.returncode == 0, report
    assert "unprotected for" in report and "No space left" in report, report


def test_a_stalled_save_is_failed_its_writer_replaced_and_training_goes_on(
    reference: str, tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    plan = tmp_path / "plan.yaml"
    # Fired at a step that saves nothing: rank 0's writer stalls the next save, step 3's.
    plan.write_text(
        "faults:\n  - {step: 1, rank: 0, kind: storage-fail, error: stall, ranks: [0]}\n"
    )
    # The other saves must not take 2 s (persist_timeout_s) on a busy machine: on a tmpfs (a
    # save's fsyncs would wait for every other test's writes), by writers at the trainers'
    # priority (an idle one runs only when nothing else on the machine wants the CPU).
    ckpt = tmpfs("256m") / "ckpt"
    flags = ["--ckpt-dir", str(ckpt), "--writer-priority", "equal"]
    flags += ["--faults", str(plan), "--ckpt-persist-timeout-s", "2"]
    cmd = _cmd(tmp_path, *flags)
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert _hashes(res) == [reference, reference]
    events = read_events(tmp_path)
    _no_restart(events)
    # The save rank 0's writer stalled (its log names it) failed after 2 s, its writer killed.
    stall = r"rank 0: failing the save of step (\d+): storage-fail stall"
    (stalled,) = re.findall(stall, res.output)
    assert stalled == "3", res.output[-3000:]
    fails = [e for e in events if e.kind == "ckpt_fail"]
    (failed,) = [
        e
        for e in fails
        if (e.rank, e.get("step")) == (0, int(stalled))
        and "not durable after 2.0 s" in e.get("error")
        and "Its writer was killed" in e.get("error")
    ]
    # Nothing else failed but saves past the same timeout: a rank that waited for the stalled
    # part, or, on a busy machine, a save slower than 2 s (a real timeout, handled alike).
    timeouts = ("not durable after 2.0 s", "did not finish writing", "by rank 0 within 2.0 s")
    assert all(any(t in e.get("error") for t in timeouts) for e in fails), fails
    # The storage is back: a new writer commits later saves.
    commits = [e.get("step") for e in events if e.kind == "ckpt_commit" and e.ts > failed.ts]
    assert commits and min(commits) > int(stalled), commits
    storage = goodput.compute(events).storage
    assert storage.failed_saves >= 1 and 0 < storage.unprotected_s < 60


def test_stop_policy_ends_the_job_once_storage_failed_for_its_limit(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    mnt = tmpfs("1m")
    (mnt / "ckpt").mkdir()
    _fill(mnt / "filler")
    flags = ["--on-storage-failure", "stop", "--storage-failure-limit-s", "0.5"]
    res = run(_cmd(tmp_path, "--ckpt-dir", str(mnt / "ckpt"), *flags), timeout_s=TIMEOUT_S)
    assert res.returncode == 6, res.output[-3000:]  # EXIT_STORAGE_FAILED: not restarted
    assert "StorageFailed" in res.output and "the final save" in res.output, res.output[-3000:]
    events = read_events(tmp_path)
    assert {e.attempt for e in events} == {0}  # the launcher restarted nothing
    launcher = [e for e in events if e.kind == "restart_end" and e.get("layer") == "launcher"]
    assert not launcher  # the job ended at the first StorageFailed (a peer it interrupted may
    # have begun an in-process iteration meanwhile: the launcher stopped it)
    error = json.loads((tmp_path / "error.json").read_text())
    assert (error["cause"], error["category"], error["exit_code"]) == ("storage", "infra", 74)


def test_storage_turning_read_only_mid_run(
    reference: str, tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    mnt = tmpfs("64m")
    ckpt = mnt / "ckpt"
    proc = popen(
        _cmd(tmp_path, "--ckpt-dir", str(ckpt)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (ckpt.exists() and layout.committed_steps(ckpt)):
            assert proc.poll() is None, "the run ended before its first commit"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    hashes = [line.split("=", 1)[1] for line in out.splitlines() if "final_state_sha256=" in line]
    assert hashes == [reference, reference], out[-3000:]
    events = read_events(tmp_path)
    _no_restart(events)
    commits = [e for e in events if e.kind == "ckpt_commit"]
    fails = [e for e in events if e.kind == "ckpt_fail"]
    assert fails and all("Read-only" in e.get("error") for e in fails), fails
    assert commits and max(e.ts for e in commits) < min(e.ts for e in fails)
    for step in layout.committed_steps(ckpt):  # what was committed stays whole
        assert layout.verify(layout.step_dir(ckpt, step)) is None
    assert os.statvfs(mnt).f_flag & os.ST_RDONLY
