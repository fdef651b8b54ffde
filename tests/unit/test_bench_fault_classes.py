"""The recovery benchmark's figures per fault class and per phase: each run's JSON row, and the
tables over each configuration's runs pooled."""

from __future__ import annotations

import pytest

from timelines import faulty_run, steps
from unbroken.bench.fault_classes import format_fault_classes
from unbroken.bench.recovery_table import ConfigResult
from unbroken.ledger.goodput import compute


def _result(config: str, events, run: int = 1) -> ConfigResult:
    return ConfigResult(config, config, 0, figures=compute(events).to_dict(), run=run)


def _rows(text: str, section: str, config: str) -> list[list[str]]:
    part = text.split(section)[1].split("\n\n")[0]
    return [line.split() for line in part.splitlines() if line.startswith(config + " ")]


def test_rows_carry_each_runs_figures_and_tables_pool_the_rounds() -> None:
    # faulty_run: exception faults, each detected in 0.1 s, training again 2 s after it.
    # Three faults at 10, 20, 30 lose 4, 8 and 8 steps; one at 10 loses 4.
    results = [
        _result("clean", steps(0, 9, 0.0)),
        _result("inprocess", faulty_run()),
        _result("inprocess", faulty_run(faults_at=(10.0,)), run=2),
    ]
    row = results[1].row()
    assert row["by_class"]["exception"]["faults"] == 3
    assert row["by_class"]["exception"]["steps_lost"] == 20
    assert row["by_phase"]["step"]["recovery_rate"] == 1.0
    assert results[0].row()["by_class"] == {}

    text = format_fault_classes(results)
    assert "each configuration's runs pooled" in text
    [cls] = _rows(text, "recovery per fault class", "inprocess")
    # config, class, faults, recovered (rate), recovery s p50 / p95 / max, failed restarts,
    # steps lost (total, max, per incident), detection s p50
    assert cls == [
        "inprocess",
        "exception",
        "4",
        "4",
        "(100%)",
        "2.000",
        "2.000",
        "2.000",
        "0",
        "24",
        "8",
        "6.0",
        "0.100",
    ]
    [phase] = _rows(text, "recovery per phase", "inprocess")
    assert phase[:3] == ["inprocess", "step", "4"]
    assert not _rows(text, "recovery per fault class", "clean")


def test_no_faults_no_tables() -> None:
    assert format_fault_classes([_result("clean", steps(0, 9, 0.0))]) == ""
    assert format_fault_classes([ConfigResult("baseline", "b", 1)]) == ""  # no ledger


def test_a_run_without_the_new_fields_still_reads() -> None:
    """A row written before faults had a class reads as class other, phase unknown."""
    figures = compute(faulty_run()).to_dict()
    for f in figures["faults"]:
        del f["fault_class"], f["phase"], f["restarts"]
    text = format_fault_classes([ConfigResult("old", "old", 0, figures=figures)])
    [row] = _rows(text, "recovery per fault class", "old")
    assert row[:3] == ["old", "other", "3"]
    assert _rows(text, "recovery per phase", "old")[0][1] == "unknown"
    assert float(row[5]) == pytest.approx(2.0)
