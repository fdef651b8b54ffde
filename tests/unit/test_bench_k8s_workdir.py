"""``unbroken bench k8s`` re-run into the same ``--out``: an earlier run's ledger must not read
as the new run's progress; a directory that is not ours is never deleted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from unbroken.bench import k8s
from unbroken.ledger import events as ev


def _stale_run(workdir: Path) -> Path:
    events = workdir / "volume" / "ft" / "events"
    events.mkdir(parents=True)
    records = [
        {"kind": "step", "rank": 0, "step": 15, "ts": 1.0},
        {"kind": ev.PHASE, "rank": ev.LAUNCHER_RANK, "name": "connect", "host": "ft-0", "ts": 1.0},
    ]
    (events / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (workdir / "cluster.log").write_text("earlier run\n")
    return workdir / "volume" / "ft"


def test_an_earlier_run_is_replaced(tmp_path: Path) -> None:
    workdir = tmp_path / "spare"
    run_dir = _stale_run(workdir)
    before = k8s.LedgerTail(run_dir)
    before.poll()
    assert before.step(0) == 15 and before.connected() == {"ft-0"}  # what the bug saw
    k8s.fresh_workdir(workdir)
    assert workdir.is_dir() and list(workdir.iterdir()) == []
    after = k8s.LedgerTail(run_dir)
    assert after.poll() == [] and after.step(0) == -1 and after.connected() == set()


def test_a_new_or_empty_workdir_is_made(tmp_path: Path) -> None:
    k8s.fresh_workdir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    k8s.fresh_workdir(tmp_path / "a" / "b")  # empty: fine too
    assert (tmp_path / "a" / "b").is_dir()


def test_a_foreign_directory_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "mine.txt").write_text("not a bench run")
    with pytest.raises(ValueError, match="--out"):
        k8s.fresh_workdir(tmp_path / "clean")
    assert (tmp_path / "clean" / "mine.txt").read_text() == "not a bench run"
    (tmp_path / "spare").write_text("a file")
    with pytest.raises(ValueError, match="is a file"):
        k8s.fresh_workdir(tmp_path / "spare")
    assert (tmp_path / "spare").read_text() == "a file"


def test_main_refuses_a_foreign_out_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "mine.txt").write_text("x")
    p = argparse.ArgumentParser()
    k8s.add_arguments(p)
    assert k8s.main(p.parse_args(["--out", str(tmp_path)])) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "clean" in err and "--out" in err
    assert (tmp_path / "clean" / "mine.txt").exists()
    assert not (tmp_path / "clean" / "volume").exists()  # nothing ran


def test_main_refuses_a_store_loss_after_the_node_loss_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = argparse.ArgumentParser()
    k8s.add_arguments(p)
    argv = ["--out", str(tmp_path), "--at-step", "15", "--lose-store-at-step", "20"]
    assert k8s.main(p.parse_args(argv)) == 2
    assert "--lose-store-at-step" in capsys.readouterr().err
    assert not (tmp_path / "clean").exists()  # nothing ran


@pytest.mark.parametrize("flag", ["--rdzv-poll-s", "--membership-check-s"])
def test_main_refuses_a_poll_interval_that_is_not_positive_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    p = argparse.ArgumentParser()
    k8s.add_arguments(p)
    assert k8s.main(p.parse_args(["--out", str(tmp_path), flag, "0"])) == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag[2:].replace("-", "_") in err and "> 0" in err
    assert not (tmp_path / "clean").exists()  # nothing ran
