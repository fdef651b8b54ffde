"""The shadow benchmark's pieces: how a run is judged against the fault-free ones, what a
target command may be, and the environment each configuration gets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from unbroken.bench.judge import by_loss, judge, ledger_digest, references_agree
from unbroken.bench.recovery import _schedule
from unbroken.bench.target import Target, configuration_env
from unbroken.ledger import Event
from unbroken.ledger import events as ev

TWINS = [{0: 2.0, 1: 1.5, 2: 1.2}, {0: 2.0, 1: 1.52, 2: 1.19}]


def test_deterministic_twins_judge_by_hash() -> None:
    v = judge("a", {}, reference_hashes=["a", "a"], reference_curves=TWINS)
    assert (v.by, v.ok, v.text()) == ("hash", True, "yes")
    v = judge("b", {}, reference_hashes=["a", "a"], reference_curves=TWINS)
    assert (v.by, v.ok, v.text()) == ("hash", False, "NO")


def test_twins_that_disagree_judge_by_the_loss_curve() -> None:
    assert references_agree(["a", "b"]) is False and references_agree(["a", None]) is None
    inside = {0: 2.0, 1: 1.53, 2: 1.18}  # within the band widened by its width
    v = judge("c", inside, reference_hashes=["a", "b"], reference_curves=TWINS)
    assert (v.by, v.ok, v.within) == ("loss", True, 1.0)
    outside = {0: 2.0, 1: 1.9, 2: 1.8}
    v = judge("c", outside, reference_hashes=["a", "b"], reference_curves=TWINS)
    assert (v.by, v.ok) == ("loss", False) and v.text() == "LOSS 33%"


def test_identical_twins_leave_a_relative_margin_only() -> None:
    twins = [{0: 1.0, 1: 0.5}, {0: 1.0, 1: 0.5}]
    assert by_loss({0: 1.0, 1: 0.50001}, twins).ok is True
    assert by_loss({0: 1.0, 1: 0.51}, twins).within == 0.5


def test_nothing_to_compare_is_said_so() -> None:
    v = judge(None, {}, reference_hashes=[None, None], reference_curves=[{}, {}])
    assert (v.by, v.ok, v.text()) == ("none", None, "unchecked")


def test_the_ledger_digest_joins_each_ranks_last_record() -> None:
    def rec(rank: int, ts: float, digest: str) -> Event:
        return Event(kind=ev.FINAL_STATE, ts=ts, rank=rank, data={"digest": digest})

    a = ledger_digest([rec(0, 1.0, "x"), rec(1, 1.0, "y")])
    b = ledger_digest([rec(1, 1.0, "y"), rec(0, 0.5, "old"), rec(0, 1.0, "x")])
    assert a == b and a is not None and len(a) == 64
    assert ledger_digest([rec(0, 1.0, "x"), rec(1, 1.0, "z")]) != a
    assert ledger_digest([]) is None


def test_a_command_is_a_python_script_or_a_module(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import unbroken\n")
    t = Target.user([str(script), "--lr", "1e-3"])
    assert t.argv == (str(script.resolve()), "--lr", "1e-3") and t.source_mentions_unbroken()
    assert Target.user(["python", str(script)]).argv[0] == str(script.resolve())
    assert Target.user(["-m", "unbroken.workload.train"]).reference
    plain = Target.user(["-m", "json.tool"])
    assert not plain.source_mentions_unbroken()
    assert plain.plain().launcher_argv() == ["-m", "unbroken.observe", "-m", "json.tool"]
    with pytest.raises(ValueError, match="no such file"):
        Target.user([str(tmp_path / "missing.py")])
    (tmp_path / "run.sh").write_text("echo\n")
    with pytest.raises(ValueError, match="not a Python script"):
        Target.user([str(tmp_path / "run.sh")])
    with pytest.raises(ValueError, match="no such module"):
        Target.user(["-m", "no_such_module_anywhere"])
    with pytest.raises(ValueError, match="give the command after --"):
        Target.user([])


def test_a_configuration_reaches_the_script_by_environment_only(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "UNBROKEN_CKPT_MODE": "sync", "UNBROKEN_FAULTS": "/elsewhere.yaml"}
    env = configuration_env(
        run_dir=tmp_path,
        plan=None,
        inprocess=False,
        ckpt_mode=None,
        memory_tier=False,
        snapshot_every=3,
        soft_timeout_s=0.5,
        max_rank_faults=None,
        base=base,
    )
    assert env["PATH"] == "/bin" and env["UNBROKEN_RUN_DIR"] == str(tmp_path)
    assert "UNBROKEN_CKPT_MODE" not in env and "UNBROKEN_FAULTS" not in env  # not inherited
    assert env["UNBROKEN_INPROCESS"] == "0" and env["UNBROKEN_MEMORY_TIER"] == "0"
    assert "UNBROKEN_SNAPSHOT_EVERY" not in env and "UNBROKEN_SOFT_TIMEOUT_S" not in env
    plan = tmp_path / "plan.yaml"
    env = configuration_env(
        run_dir=tmp_path,
        plan=plan,
        inprocess=True,
        ckpt_mode="sync",
        memory_tier=True,
        snapshot_every=3,
        soft_timeout_s=0.5,
        max_rank_faults=4,
        base={},
    )
    assert env["UNBROKEN_FAULTS"] == str(plan) and env["UNBROKEN_CKPT_MODE"] == "sync"
    assert (env["UNBROKEN_SOFT_TIMEOUT_S"], env["UNBROKEN_HARD_TIMEOUT_S"]) == ("0.5", "1.5")
    assert env["UNBROKEN_SNAPSHOT_EVERY"] == "3" and env["UNBROKEN_MAX_RANK_FAULTS"] == "4"


def test_a_command_without_another_fault_free_run_runs_clean_twice() -> None:
    a = argparse.Namespace(repeat=1)
    user, reference = Target(argv=("x.py",)), Target(argv=("-m", "m"), reference=True)
    assert _schedule(a, ["clean", "inprocess"], user) == [
        ("clean", 1),
        ("clean", 2),
        ("inprocess", 1),
    ]
    assert _schedule(a, ["inprocess-nofault", "inprocess"], user)[:2] == [
        ("clean", 1),
        ("inprocess-nofault", 1),
    ]
    assert _schedule(a, ["inprocess"], reference) == [("clean", 1), ("inprocess", 1)]


def test_an_earlier_runs_directories_logs_plan_and_report_are_removed_and_nothing_else(
    tmp_path: Path,
) -> None:
    """A run adds its records to the ledger it finds: a second benchmark into the same --out
    would read as one run with the first."""
    from unbroken.bench.recovery import clear_earlier_run

    for run in ("clean", "inprocess.run2"):
        (tmp_path / run / "events").mkdir(parents=True)
        (tmp_path / f"{run}.log").write_text("output")
    (tmp_path / "launcher").mkdir()  # no ledger: not a run
    (tmp_path / "clean2" / "events").mkdir(parents=True)  # not a configuration's name
    for name in ("plan.yaml", "report.html", "results.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    removed = clear_earlier_run(tmp_path)
    assert removed == [
        "clean",
        "clean.log",
        "inprocess.run2",
        "inprocess.run2.log",
        "plan.yaml",
        "report.html",
    ]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["clean2", "launcher", "notes.txt", "results.json"]
    assert clear_earlier_run(tmp_path) == []
