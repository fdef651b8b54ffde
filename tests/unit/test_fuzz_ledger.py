"""Property-based fuzzing of the ledger's readers: no line makes ``parse_line`` raise anything
but ValueError, ``read_run``/``LedgerTail`` skip what is not a record (counted as bad lines),
and ``unbroken report`` answers every ledger with figures or a one-line error, never a
traceback (issue 12: a well-formed JSON line that is not an object crashed it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken import cli
from unbroken.ledger import read_run
from unbroken.ledger.events import KINDS
from unbroken.ledger.reader import parse_line
from unbroken.ledger.tail import LedgerTail

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)
# Records that look like ours, with any type in any field.
FIELDS = ("ts", "run", "rank", "attempt", "iteration", "step", "dur_s", "layer", "cause", "tier")
records = st.fixed_dictionaries(
    {"kind": st.sampled_from(sorted(KINDS)) | json_values},
    optional={name: json_values | st.integers(0, 50) for name in FIELDS},
)


def _line(obj: object) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


@FUZZ
@given(st.one_of(st.binary(max_size=64), records.map(_line), json_values.map(_line)))
@pytest.mark.slow
def test_parse_line_raises_only_value_error(line: bytes) -> None:
    try:
        event = parse_line(line)
    except ValueError:
        return
    assert event.kind in KINDS and math.isfinite(event.ts)
    assert all(isinstance(getattr(event, f), int) for f in ("rank", "attempt", "iteration"))


@pytest.mark.parametrize(
    "line",
    [
        b"[1, 2]",
        b'"a string"',
        b"3",
        b"null",
        b'{"ts": 1, "kind": "step", "rank": 1e400}',
        b'{"ts": NaN, "kind": "step"}',
        b'{"ts": 1, "kind": "step", "step": "seven"}',
        b'{"ts": 1, "kind": "step", "dur_s": "x"}',
        b"[" * 100_000,
        b"\xff\xfe",
    ],
)
def test_lines_that_are_not_records_are_bad_lines(tmp_path: Path, line: bytes, capsys) -> None:
    (tmp_path / "events").mkdir()
    good = b'{"ts": 1.0, "kind": "process_start", "rank": 0, "pid": 1}\n'
    (tmp_path / "events" / "a.jsonl").write_bytes(good + line + b"\n" + good)
    result = read_run(tmp_path)
    assert len(result.events) == 2 and result.bad_lines == ["a.jsonl:2"]
    tail = LedgerTail(tmp_path)
    assert len(tail.poll()) == 2 and tail.bad_lines == ["a.jsonl:2"]
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "1 unparsable line" in capsys.readouterr().out


@settings(FUZZ, max_examples=50)
@given(st.lists(st.one_of(records.map(_line), st.binary(max_size=16)), min_size=1, max_size=8))
@pytest.mark.slow
def test_report_never_raises(tmp_path_factory: pytest.TempPathFactory, lines: list[bytes]) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "events").mkdir()
    (run_dir / "events" / "r.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert cli.main(["report", str(run_dir), "--json", "-"]) in (0, 2)
