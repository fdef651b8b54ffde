"""Node checks before the rendezvous (``--ft-node-checks``): a node whose checkpoint storage is
read-only (a real tmpfs remounted so) stays out of the job with exit code 7 and says why; a
healthy node runs the checks, records them and trains."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from procs import run, unbroken_run_cmd
from unbroken.launcher import errors
from unbroken.ledger import read_events


def _cmd(run_dir: Path, ckpt: Path) -> list[str]:
    checks = ["--ft-node-checks", "checkpoint,shm,clock", "--ft-node-check-dir", str(ckpt)]
    return unbroken_run_cmd(
        run_dir,
        nproc=1,
        steps=2,
        extra=["--batch-size", "2", "--ckpt-dir", str(ckpt)],
        launcher_args=checks,
    )


def test_a_node_with_read_only_checkpoint_storage_stays_out(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    mnt = tmpfs("4m")
    (mnt / "ckpt").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    res = run(_cmd(tmp_path / "run", mnt / "ckpt"), timeout_s=120)
    assert res.returncode == errors.EXIT_NODE_UNHEALTHY, res.output[-3000:]
    assert "failed its node checks" in res.output and "checkpoint" in res.output, res.output
    error = json.loads((tmp_path / "run" / "error.json").read_text())
    assert (error["cause"], error["category"]) == ("node_check", "platform"), error
    events = read_events(tmp_path / "run")
    assert not [e for e in events if e.rank >= 0]  # no worker started
    (phase,) = [e for e in events if e.kind == "phase" and e.get("name") == "node_check"]
    statuses = {c["name"]: c["status"] for c in phase.get("checks")}
    assert statuses["checkpoint"] == "fail" and statuses["clock"] != "fail", statuses
    (found,) = [c["found"] for c in phase.get("checks") if c["name"] == "checkpoint"]
    assert "Read-only" in found, found


def test_a_healthy_node_runs_its_checks_then_trains(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    res = run(_cmd(tmp_path / "run", tmp_path / "ckpt"), timeout_s=120)
    assert res.returncode == 0, res.output[-3000:]
    assert len(res.hashes()) == 1
    events = read_events(tmp_path / "run")
    (phase,) = [e for e in events if e.kind == "phase" and e.get("name") == "node_check"]
    assert [c["name"] for c in phase.get("checks")] == ["checkpoint", "shm", "clock"]
    assert all(c["status"] != "fail" for c in phase.get("checks"))
    first_worker = min(e.ts for e in events if e.rank >= 0)
    assert phase.ts <= first_worker  # checked before anything ran
