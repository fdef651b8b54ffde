"""Plan parsing of the storage and node fault kinds: parameters, defaults, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from unbroken import cli
from unbroken.faults import KINDS, parse_plan
from unbroken.faults.plan import NON_DISRUPTIVE, PARAMS

NEW_KINDS = ("slow-storage", "checkpoint-corruption", "node-loss")


def one(kind: str, **params: Any) -> dict[str, Any]:
    return {"faults": [{"step": 4, "rank": 1, "kind": kind, **params}]}


def test_new_kinds_are_known_and_only_the_degrading_ones_are_non_disruptive() -> None:
    assert set(NEW_KINDS) <= set(KINDS) and set(NEW_KINDS) <= set(PARAMS)
    assert set(NON_DISRUPTIVE) == {"slow-storage", "storage-fail", "slow-rank", "network"}
    plan = parse_plan({"faults": [{"step": 1, "rank": 0, "kind": k} for k in NEW_KINDS]})
    assert [f.disruptive for f in plan.faults] == [False, True, True]


def test_defaults_are_filled_in() -> None:
    (slow,) = parse_plan(one("slow-storage")).faults
    assert slow.params == {}
    assert slow.settings() == {"mbps": 5.0, "saves": 3, "seconds": None, "ranks": [1]}
    assert slow.targets() == [1]
    (timed,) = parse_plan(one("slow-storage", mbps=0.5, seconds=2, ranks="all")).faults
    assert timed.settings() == {"mbps": 0.5, "saves": None, "seconds": 2, "ranks": "all"}
    assert timed.targets() is None
    (listed,) = parse_plan(one("slow-storage", ranks=[3, 0, 3])).faults
    assert listed.targets() == [0, 3]
    (corrupt,) = parse_plan(one("checkpoint-corruption")).faults
    assert corrupt.settings() == {"target": "data"}
    (manifest,) = parse_plan(one("checkpoint-corruption", target="manifest")).faults
    assert manifest.settings() == {"target": "manifest"}
    (node,) = parse_plan(one("node-loss")).faults
    assert node.settings() == {} and node.targets() == [1]


@pytest.mark.parametrize(
    ("entry", "msg"),
    [
        (one("slow-storage", mbs=3), r"unknown parameter\(s\) \['mbs'\].*takes mbps, saves"),
        (one("slow-storage", mbps=0), r"mbps must be a number > 0 \(MB/s\), got 0"),
        (one("slow-storage", mbps="fast"), "mbps must be a number > 0.*'fast'"),
        (one("slow-storage", mbps=True), "mbps must be a number > 0"),
        (one("slow-storage", saves=0), "saves must be an integer >= 1"),
        (one("slow-storage", saves=1.5), "saves must be an integer >= 1"),
        (one("slow-storage", seconds=-1), "seconds must be a number > 0"),
        (one("slow-storage", saves=2, seconds=3), "give saves .* or seconds .*, not both"),
        (one("slow-storage", ranks="some"), "ranks must be 'all' or a list of ranks"),
        (one("slow-storage", ranks=[]), "ranks must be 'all' or a list"),
        (one("slow-storage", ranks=[0, -1]), "ranks must be 'all' or a list"),
        (one("checkpoint-corruption", target="metadata"), "target must be one of data, manifest"),
        (one("checkpoint-corruption", file="x"), r"unknown parameter\(s\) \['file'\]"),
        (one("node-loss", nodes=2), r"\['nodes'\] for node-loss; it takes no parameters"),
    ],
)
def test_bad_params_say_what_is_wrong_and_what_to_do(entry: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as info:
        parse_plan(entry, source="plan.yaml")
    text = str(info.value)
    assert text.startswith("plan.yaml: fault #0 (")  # where: the file and the entry
    assert "fix it or leave it out" in text or "takes" in text or "not both" in text


def test_check_world_covers_the_slowed_ranks() -> None:
    plan = parse_plan(one("slow-storage", ranks=[0, 2]))
    with pytest.raises(ValueError, match="targets rank 2, but the world has 2 ranks"):
        plan.check_world(2)
    plan.check_world(3)
    parse_plan(one("slow-storage", ranks="all")).check_world(2)


def test_random_schedule_accepts_the_new_kinds() -> None:
    spec = {"random": {"count": 9, "kinds": list(NEW_KINDS), "seed": 7, "steps": [10, 30]}}
    plan = parse_plan(spec, world_size=2)
    assert len(plan) == 9 and {f.kind for f in plan.faults} == set(NEW_KINDS)
    assert all(f.params == {} for f in plan.faults)  # defaults at fire time


@pytest.fixture
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "init_logging", lambda: None)  # leave the test process's logging


@pytest.mark.usefixtures("no_logging_setup")
def test_faults_show_lists_the_new_kinds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "faults:\n"
        "  - {step: 5, rank: 0, kind: slow-storage, mbps: 2, ranks: all}\n"
        "  - {step: 9, rank: 1, kind: checkpoint-corruption, target: manifest}\n"
        "  - {step: 12, rank: 1, kind: node-loss}\n"
    )
    assert cli.main(["faults", "show", str(plan), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "3 fault(s)" in lines[0]
    assert "step     5 on rank   0: slow-storage " in lines[1]
    assert "(mbps=2.0, saves=3, ranks=all)" in lines[2]
    assert "step     9 on rank   1: checkpoint-corruption " in lines[3]
    assert "(target=manifest)" in lines[4]
    assert "step    12 on rank   1: node-loss " in lines[5] and KINDS["node-loss"] in lines[5]
    # the kind column is as wide as the longest kind: descriptions line up
    starts = {line.index(KINDS[k]) for line, k in zip(lines[1::2][:2], NEW_KINDS, strict=False)}
    assert len(starts | {lines[5].index(KINDS["node-loss"])}) == 1


@pytest.mark.usefixtures("no_logging_setup")
def test_faults_show_rejects_bad_params(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults: [{step: 1, rank: 0, kind: slow-storage, mbps: -2}]\n")
    assert cli.main(["faults", "show", str(plan)]) != 0
    assert "mbps must be a number > 0" in capsys.readouterr().err
