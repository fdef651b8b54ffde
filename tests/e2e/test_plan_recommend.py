"""``unbroken plan --from RUN --recommend`` on a real run of the reference script: the
recommendation agrees with what that run's ledger measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from procs import VENV_BIN, run, train_cmd
from unbroken.ledger import read_events
from unbroken.plan.tune import (
    ENV_CKPT_EVERY,
    ENV_PHASE_TIMEOUTS,
    ENV_SNAPSHOT_EVERY,
    ENV_SOFT_TIMEOUT,
    effective,
)


def test_recommend_on_a_real_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    extra = ["--ckpt-every", "5", "--snapshot-every", "1"]
    job = run(train_cmd(run_dir, nproc=None, steps=30, extra=extra), timeout_s=120)
    assert job.returncode == 0, job.output[-3000:]

    plan = [str(VENV_BIN / "unbroken"), "plan", "--from", str(run_dir), "--recommend"]
    text = run(plan, timeout_s=60)
    assert text.returncode == 0, text.output[-3000:]
    assert "hang timeouts:" in text.output
    res = run([*plan, "--json", "-"], timeout_s=60)
    assert res.returncode == 0, res.output[-3000:]
    doc = json.loads(res.output[res.output.index("{") :])
    obs, rec = doc["observed"], doc["recommendation"]
    assert obs["steps_completed"] == 30 and obs["ckpt_every"] == 5
    # Every snapshot rank 0 staged (one per step unless the writer was busy: skipped).
    stages = [e for e in read_events(run_dir) if e.kind == "ckpt_stage" and e.rank == 0]
    snapshots = [e for e in stages if e.get("durable") is False and e.get("part") != "note"]
    assert obs["save_s"]["count"] >= 1 and obs["snapshot_s"]["count"] == len(snapshots) >= 1

    # The durable interval is never below the steps a save took to become durable.
    step_s = doc["job"]["step_time_s"]
    durable_s = obs["durable_lag_s"]["max"] or obs["persist_s"]["max"]
    lag = math.ceil(durable_s / step_s)
    assert rec["ckpt_every"] >= lag
    (own,) = [c for c in rec["ckpt_choices"] if c["every"] == 5]
    assert own["effective"] == effective(5, lag)

    # The snapshot interval is the most frequent within 1% of a step: a snapshot every m steps
    # and a note at each of the others (notes are seen where a snapshot waited for the writer
    # to write the last save from the rank's one copy).
    snap, note = obs["snapshot_s"]["median"], obs["note_s"]["median"] or 0.0
    m = rec["snapshot_every"]

    def blocking(c: int) -> float:
        return (snap + (c - 1) * note) / c

    if note < 0.01 * step_s:
        assert blocking(m) <= 0.01 * step_s * (1 + 1e-6)
        assert m == 1 or blocking(m - 1) > 0.01 * step_s
    else:  # no interval is within 1%: the one of best predicted goodput among a few
        assert m in {1, 2, 4, 8, 16, 32, rec["ckpt_every"]}

    # Each timeout is 8 x the longest seen, at least 1 s, rounded up.
    timeouts = {t["name"]: t for t in rec["timeouts"]}
    assert {"step", "import", "model_build", "save", "persist", "restore"} <= set(timeouts)
    for name, t in timeouts.items():
        longest = obs["gap_s"]["max"] if name == "step" else obs["phases"][name]["max"]
        assert t["longest_s"] == pytest.approx(longest)
        assert max(1.0, 8 * longest) <= t["timeout_s"] <= max(1.0, 8 * longest) + 1.0

    env = rec["env"]
    assert env[ENV_CKPT_EVERY] == str(rec["ckpt_every"])
    assert env[ENV_SNAPSHOT_EVERY] == str(m)
    assert float(env[ENV_SOFT_TIMEOUT]) == timeouts["step"]["timeout_s"]
    assert f"import={timeouts['import']['timeout_s']:g}" in env[ENV_PHASE_TIMEOUTS].split(",")
    assert rec["env_line"] in text.output
