"""unbroken-run ends a job whose workers report a configuration error at once (exit 2), with
the worker's message in the error file, instead of a restart storm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from procs import run, unbroken_run_cmd
from unbroken.launcher import errors
from unbroken.ledger import read_events

WORKERS = Path(__file__).resolve().parents[1] / "workers_launcher"


@pytest.mark.timeout(120)
def test_unbroken_run_ends_a_misconfigured_job_at_once(tmp_path: Path) -> None:
    """Also: what the agent and its workers create is private to the user (umask 077)."""
    run_dir = tmp_path / "run"
    cmd = unbroken_run_cmd(
        run_dir,
        nproc=2,
        steps=None,
        target=[str(WORKERS / "config_error.py")],
        launcher_args=["--max-restarts", "5", "--ft-max-no-progress-restarts", "0"],
    )
    res = run(cmd, timeout_s=100)
    assert res.returncode == errors.EXIT_USAGE, res.output[-3000:]
    assert "Traceback" not in res.output.split("configuration error")[0][-200:]
    err = json.loads((run_dir / "error.json").read_text())
    assert (err["cause"], err["reason"], err["restarts"]) == ("config", "config_error", 0)
    assert "--lr must be > 0" in err["message"]
    starts = [e for e in read_events(run_dir) if e.kind == "worker_exit"]
    assert len(starts) == 2  # one round of two workers, no restart
    made = [run_dir, *run_dir.rglob("*")]
    assert {p.stat().st_mode & 0o777 for p in made if p.is_dir()} == {0o700}
    assert {p.stat().st_mode & 0o777 for p in made if p.is_file()} == {0o600}
    assert any(p.parent.name == "events" for p in made)  # the workers' ledgers too
