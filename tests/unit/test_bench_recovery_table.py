"""The recovery benchmark's gaps: a faulted run against its fault-free twin, else clean."""

from __future__ import annotations

import pytest

from unbroken.bench.recovery_table import (
    ConfigResult,
    format_summary,
    format_table,
    set_gaps,
    summarize,
)


def _result(name: str, goodput: float | None) -> ConfigResult:
    figures = {} if goodput is None else {"training_goodput": goodput, "wall_s": 100.0}
    return ConfigResult(name, name, 0, figures=figures)


def test_the_gap_is_taken_against_the_twin_else_clean() -> None:
    results = [
        _result("clean", 0.98),
        _result("inprocess-nofault", 0.975),
        _result("inprocess", 0.97),
        _result("launcher", 0.96),
        _result("baseline", None),  # left no ledger: no gap
    ]
    set_gaps(results)
    gaps = {r.config: (r.reference, r.gap) for r in results}
    assert gaps["inprocess"] == ("inprocess-nofault", pytest.approx(0.005))
    assert gaps["launcher"] == ("clean", pytest.approx(0.02))
    assert gaps["clean"] == gaps["inprocess-nofault"] == gaps["baseline"] == (None, None)
    table = format_table(results)
    assert "inprocess against inprocess-nofault" in table and "launcher against clean" in table
    assert results[2].row()["goodput_gap"] == pytest.approx(0.005)


def _round(name: str, run: int, goodput: float, fault_s: float = 0.0) -> ConfigResult:
    figures = {"training_goodput": goodput, "wall_s": 100.0, "fault_s": fault_s}
    return ConfigResult(name, name, 0, figures=figures, matches_clean=True, run=run)


def test_repeated_runs_take_their_own_rounds_twin_and_summarize_as_medians() -> None:
    results = [_result("clean", 0.98)]
    for run, (twin, faulted, cost) in enumerate(
        [(0.975, 0.97, 0.8), (0.965, 0.95, 1.1), (0.97, 0.961, 0.9)], start=1
    ):
        results += [_round("inprocess-nofault", run, twin), _round("inprocess", run, faulted, cost)]
    set_gaps(results)
    faulted = [r for r in results if r.config == "inprocess"]
    # Each round's run against the twin of that round, never another round's.
    assert [r.reference for r in faulted] == [
        "inprocess-nofault",
        "inprocess-nofault.run2",
        "inprocess-nofault.run3",
    ]
    assert [r.gap for r in faulted] == [pytest.approx(g) for g in (0.005, 0.015, 0.009)]
    assert [r.name for r in faulted] == ["inprocess", "inprocess.run2", "inprocess.run3"]
    docs = {d["config"]: d for d in summarize(results)}
    assert set(docs) == {"inprocess-nofault", "inprocess"}  # clean ran once: no summary
    gap = docs["inprocess"]["goodput_gap"]
    assert gap == {"median": pytest.approx(0.009), "low": pytest.approx(0.005),
                   "high": pytest.approx(0.015)}  # fmt: skip
    assert docs["inprocess"]["fault_cost"]["median"] == pytest.approx(0.009)
    assert docs["inprocess"]["runs"] == 3 and docs["inprocess"]["all_match_clean"]
    results[-1].matches_clean = False
    table = format_summary(results)
    assert "0.90 (0.50-1.50)" in table  # the gap in points: median (low-high)
    assert table.splitlines()[-1].endswith("NO")
    assert format_summary(results[:3]) == ""  # one round: nothing to summarize
