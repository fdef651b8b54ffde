"""The knowledge base: ingest run directories, search them with FTS5, show and compare them,
and refuse bad input with a message (also through the ``unbroken kb`` CLI)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import run
from timelines import fault, faulty_run, rec, steps, write
from unbroken.kb import KnowledgeBase, text
from unbroken.ledger import events as ev


def _run(root: Path, name: str, *, mode: str, faults: list, every: int) -> Path:
    d = root / name
    events = [
        rec(
            ev.PROCESS_START,
            0.0,
            rank=ev.LAUNCHER_RANK,
            max_restarts=3,
            config={"steady_timeout_s": 30.0},
            entry=["unbroken.workload.train"],
        ),
        rec(
            ev.PROCESS_START,
            0.0,
            args={"ckpt_every": every, "ckpt_mode": mode},
            world_size=2,
            torch="2.13.0",
            host="node-a",
        ),
        *steps(0, 19, 0.0),
        *faults,
        rec(ev.JOB_END, 40.0, status="ok"),
    ]
    write(d, events)
    (d / "final.json").write_text(json.dumps({"final_state_sha256": "cd" * 32, "world_size": 2}))
    return d


@pytest.fixture
def kb(tmp_path: Path):
    k = KnowledgeBase(tmp_path / "kb.sqlite")
    yield k
    k.close()


def test_ingest_search_show_compare(tmp_path: Path, kb: KnowledgeBase) -> None:
    a = _run(
        tmp_path,
        "async-run",
        mode="async",
        every=5,
        faults=fault(21.0, kind="sigkill", layer="launcher", restored=15),
    )
    b = _run(
        tmp_path,
        "sync-run",
        mode="sync",
        every=10,
        faults=fault(21.0, kind="hang-collective", layer="inprocess", restored=10),
    )
    kb.ingest(a)
    kb.ingest(b)
    assert [h.name for h in kb.search("sigkill")] == ["async-run"]
    assert [h.name for h in kb.search("ckpt_mode=sync")] == ["sync-run"]  # not FTS5 syntax: words
    assert [h.name for h in kb.search("hang-collective")] == ["sync-run"]
    assert {h.name for h in kb.search("launcher OR inprocess")} == {"async-run", "sync-run"}
    assert [h.name for h in kb.search('"injected sigkill on rank 1"')] == ["async-run"]  # message
    assert "[sigkill]" in kb.search("sigkill")[0].snippet
    assert kb.search("nothing-like-this") == []
    with pytest.raises(ValueError, match="empty search"):
        kb.search("  ")

    rec_a = kb.get("async-run")
    assert rec_a.config["train.args.ckpt_every"] == 5 and rec_a.config["launcher.max_restarts"] == 3
    assert rec_a.faults[0]["kind"] == "sigkill" and rec_a.faults[0]["message"].startswith(
        "injected"
    )
    assert rec_a.results["final_state_sha256"] == "cd" * 32
    assert kb.get(str(a)).name == "async-run" and kb.get("1").name == "async-run"
    shown = text.show(rec_a)
    assert "train.args.ckpt_mode" in shown and "sigkill" in shown and "training goodput" in shown
    cmp = text.compare(rec_a, kb.get("sync-run"))
    assert "train.args.ckpt_mode" in cmp and "train.args.ckpt_every" in cmp
    assert "train.host" not in cmp and "train.torch" not in cmp  # only what differs
    with pytest.raises(LookupError, match="no run 'nope'"):
        kb.get("nope")


def test_ingesting_again_replaces(tmp_path: Path, kb: KnowledgeBase) -> None:
    d = _run(tmp_path, "r", mode="async", every=5, faults=[])
    kb.ingest(d)
    write(d, fault(20.5, kind="segfault", layer="launcher", restored=15) + steps(15, 16, 21.0))
    kb.ingest(d)
    assert len(kb.runs()) == 1 and kb.runs()[0]["faults"] == 1
    assert [h.name for h in kb.search("segfault")] == ["r"]
    assert kb.db.execute("select count(*) from faults").fetchone()[0] == 1


def test_bad_input(tmp_path: Path, kb: KnowledgeBase) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        kb.ingest(tmp_path / "missing")
    (tmp_path / "empty" / "events").mkdir(parents=True)
    with pytest.raises(ValueError, match="no records yet"):
        kb.ingest(tmp_path / "empty")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="not a knowledge base"):
        KnowledgeBase(junk)
    with pytest.raises(FileNotFoundError, match="ingest runs first"):
        KnowledgeBase(tmp_path / "none.sqlite", create=False)


@pytest.mark.slow
def test_cli(tmp_path: Path) -> None:
    d = _run(tmp_path, "cli-run", mode="async", every=5, faults=faulty_run()[0:0])
    db = str(tmp_path / "cli.sqlite")
    cli = [sys.executable, "-m", "unbroken.cli", "kb", "--db", db]
    res = run([*cli, "ingest", str(d), str(tmp_path / "missing")], timeout_s=60)
    assert res.returncode == 2 and "ingested cli-run" in res.output
    assert "missing is not a directory" in res.output and "Traceback" not in res.output
    res = run([*cli, "search", "ckpt_every=5"], timeout_s=60)
    assert res.returncode == 0 and "cli-run" in res.output
    res = run([*cli, "show", "nope"], timeout_s=60)
    assert res.returncode == 2 and "no run 'nope'" in res.output and "Traceback" not in res.output
    res = run([*cli, "compare", "cli-run", "cli-run"], timeout_s=60)
    assert res.returncode == 0 and "configuration that differs" in res.output
    res = run(
        [
            sys.executable,
            "-m",
            "unbroken.cli",
            "kb",
            "--db",
            str(tmp_path / "x.sqlite"),
            "search",
            "a",
        ],
        timeout_s=60,
    )
    assert res.returncode == 2 and "ingest runs first" in res.output
