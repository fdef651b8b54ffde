"""``unbroken bench recovery -- COMMAND``: the shadow benchmark of a script we did not write
into the bench. The examples (adopted) get the configurations they ask for, bit-exact; a plain
torchrun script gets those that apply to it and the reasons for the others; a script whose
fault-free runs disagree is called not deterministic and judged by its loss curve."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import Result, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
WORKERS = ROOT / "tests" / "workers_launcher"
PLAN = """faults:
  - {step: 12, rank: 1, kind: exception}
  - {step: 21, rank: 0, kind: sigkill}
  - {step: 30, rank: 1, kind: hang}
"""


def _bench(tmp_path: Path, configs: list[str], command: list[str]) -> tuple[Result, list[dict]]:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    rows = tmp_path / "rows.json"
    cmd = [
        *(sys.executable, "-m", "unbroken.cli", "bench", "recovery"),
        *("--configs", *configs),
        *("--plan", str(plan), "--hang-timeout-s", "1", "--pg-timeout-s", "5"),
        *("--pod-restart-s", "0.2", "--out", str(tmp_path / "bench")),
        *("--json", str(rows), "--kb", str(tmp_path / "kb.sqlite")),
        "--",
        *command,
    ]
    res = run(cmd, timeout_s=420)
    return res, json.loads(rows.read_text()) if rows.exists() else []


@pytest.mark.parametrize(
    ("example", "configs"),
    [
        ("ddp.py", ["inprocess", "launcher-sync", "baseline"]),
        ("fsdp.py", ["inprocess-sync", "launcher"]),
    ],
)
def test_an_adopted_example_is_benchmarked_bit_exact(
    tmp_path: Path, example: str, configs: list[str]
) -> None:
    res, rows = _bench(tmp_path, configs, [str(EXAMPLES / example)])
    assert res.returncode == 0, res.output[-4000:]
    assert "deterministic: the 2 fault-free runs ended with the same hash" in res.output
    assert [r["config"] for r in rows] == ["clean", "clean", *configs]
    for r in rows:
        assert r["judged_by"] == "hash" and r["matches_clean"], r
        assert r["hash_source"] == "printed"  # the example prints final_state_sha256=
    for r in rows[2:]:
        assert len(r["recovery_s"]) == 3 and all(x is not None for x in r["recovery_s"]), r
        assert set(r["by_class"]) == {"exception", "crash", "hang"}
    # The configuration came from outside: the ledger says what each run was given.
    starts = [
        json.loads(line)
        for f in (tmp_path / "bench" / configs[0] / "events").glob("*.jsonl")
        for line in f.read_text().splitlines()
        if '"process_start"' in line and '"adopted"' in line
    ]
    assert starts and all(s["overrides"]["final_digest"] for s in starts)
    assert "recovery per fault class" in res.output


def test_a_plain_script_gets_the_configurations_that_apply(tmp_path: Path) -> None:
    res, rows = _bench(tmp_path, ["inprocess", "launcher"], [str(EXAMPLES / "plain_ddp.py")])
    assert res.returncode == 0, res.output[-4000:]
    assert [r["config"] for r in rows] == ["clean", "clean", "launcher"]
    assert "not run: inprocess: in-process restart is unbroken.run's" in res.output
    assert all(r["matches_clean"] and r["judged_by"] == "hash" for r in rows)
    faulted = rows[-1]
    # Its optimizer steps are the observer's steps: the plan fired on them, and a restarted
    # plain script starts over (no checkpoint): steps are lost.
    assert len(faulted["recovery_s"]) == 3 and sum(faulted["steps_lost"]) > 0
    assert faulted["by_class"]["crash"]["faults"] == 1


def test_a_script_whose_fault_free_runs_differ_is_judged_by_its_loss_curve(
    tmp_path: Path,
) -> None:
    res, rows = _bench(tmp_path, ["inprocess"], [str(WORKERS / "nondeterministic.py")])
    assert res.returncode == 0, res.output[-4000:]
    assert "NOT DETERMINISTIC: the 2 fault-free runs ended with 2 different final hashes" in (
        res.output
    )
    assert len({r["final_state_sha256"] for r in rows[:2]}) == 2
    for r in rows:
        assert r["judged_by"] == "loss" and r["matches_clean"] and r["loss_within"] >= 0.95, r
