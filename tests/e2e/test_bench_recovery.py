"""`unbroken bench recovery` end to end, tiny: the table's correctness column and figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import Result, run


def _bench(tmp_path: Path, *args: str) -> Result:
    """``unbroken bench recovery ARGS`` on the tiny workload into ``tmp_path``."""
    common = ["--seq-len", "32", "--batch-size", "4", "--faults", "1"]
    out = ["--out", str(tmp_path / "bench"), "--json", str(tmp_path / "rows.json")]
    cmd = [sys.executable, "-m", "unbroken.cli", "bench", "recovery", *common, *args, *out]
    res = run([*cmd, "--kb", str(tmp_path / "kb.sqlite")], timeout_s=240)
    assert res.returncode == 0, res.output[-4000:]
    return res


def test_bench_recovery_clean_vs_baseline(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = _bench(
        tmp_path,
        *("--configs", "baseline", "--steps", "10", "--ckpt-every", "0", "--kinds", "sigkill"),
        *("--pod-restart-s", "0.2"),
    )
    rows = {r["config"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert set(rows) == {"clean", "baseline"}
    assert all(r["matches_clean"] for r in rows.values())
    assert rows["clean"]["recovery_s"] == [] and rows["clean"]["infra_goodput"] == 1.0
    assert len(rows["baseline"]["recovery_s"]) == 1 and rows["baseline"]["recovery_s"][0] > 0.2
    assert rows["baseline"]["training_goodput"] < rows["clean"]["training_goodput"]
    # The run's time splits into training, what the fault cost and what checkpointing cost
    # (none here). The fault's cost is its window and the steps redone: with every pod gone,
    # at least the 0.2 s before the pods are recreated. (Not "at least the gap to the clean
    # run": that gap also holds the two runs' other differences, start-up and step times,
    # larger than the fault's cost when pods start in a few milliseconds.)
    base = rows["baseline"]
    assert rows["clean"]["fault_cost"] == 0.0 and base["checkpoint_cost"] == 0.0
    assert base["fault_cost"] * base["wall_s"] >= 0.2
    assert base["training_goodput"] + base["fault_cost"] <= 1.0 + 1e-9
    assert rows["baseline"]["step_time_s_median"] > 0
    assert (out / "report.html").read_text().count("polyline") >= 2
    assert "clean" in res.output and "baseline" in res.output
    # What it ran is in the knowledge base, searchable by its fault.
    from unbroken.kb import KnowledgeBase

    with KnowledgeBase(tmp_path / "kb.sqlite", create=False) as kb:
        assert {r["name"] for r in kb.runs()} == {"clean", "baseline"}
        assert [h.name for h in kb.search("sigkill")] == ["baseline"]


def test_a_faulted_run_is_compared_with_its_fault_free_twin(tmp_path: Path) -> None:
    res = _bench(
        tmp_path,
        *("--configs", "launcher-nofault", "launcher", "--steps", "12", "--kinds", "exception"),
        *("--ckpt-every", "4", "--snapshot-every", "2", "--hang-timeout-s", "5"),
        *("--repeat", "2"),
    )
    doc = json.loads((tmp_path / "rows.json").read_text())
    rows = {(r["config"], r["run"]): r for r in doc}
    # clean once (the reference), the others twice, round-robin
    assert [(r["config"], r["run"]) for r in doc] == [
        ("clean", 1),
        ("launcher-nofault", 1),
        ("launcher", 1),
        ("launcher-nofault", 2),
        ("launcher", 2),
    ]
    assert all(r["matches_clean"] for r in rows.values())
    for k, twin_name in ((1, "launcher-nofault"), (2, "launcher-nofault.run2")):
        twin, faulted = rows[("launcher-nofault", k)], rows[("launcher", k)]
        assert twin["recovery_s"] == [] and twin["fault_cost"] == 0.0  # not given the plan
        assert len(faulted["recovery_s"]) == 1 and faulted["fault_cost"] > 0.0
        assert faulted["reference"] == twin_name and twin["reference"] is None
        gap = twin["training_goodput"] - faulted["training_goodput"]
        assert faulted["goodput_gap"] == pytest.approx(gap)
    assert "against launcher-nofault" in res.output
    assert "launcher.run2 against launcher-nofault.run2" in res.output
    assert "over 2 runs each" in res.output  # the medians
    assert (tmp_path / "bench" / "launcher.run2" / "final.json").exists()
