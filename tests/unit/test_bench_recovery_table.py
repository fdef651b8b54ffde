"""The recovery benchmark's gaps: a faulted run against its fault-free twin, else clean."""

from __future__ import annotations

import pytest

from unbroken.bench.recovery_table import ConfigResult, format_table, set_gaps


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
