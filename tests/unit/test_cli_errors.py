"""``unbroken`` answers bad input to its subcommands with one line and exit code 2, never a
traceback: unusable output paths, bad numbers, ports out of range, non-finite intervals."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken import cli


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "run" / "events").mkdir(parents=True)
    (tmp_path / "run" / "events" / "a.jsonl").write_text('{"ts": 1, "kind": "process_start"}\n')
    return tmp_path / "run"


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{run}", "--json", "{tmp}"],  # a directory
        ["report", "{run}", "--html", "{tmp}/no/such/dir/x.html"],
        ["report", "{tmp}/missing"],
        ["faults", "show", "{tmp}"],
        ["dashboard", "{run}", "--port", "70000"],
        ["dashboard", "{run}", "--refresh-s", "nan", "--port", "0"],
        ["kb", "--db", "{tmp}", "search", "x"],
        ["k8s", "store", "--port", "-1"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = run_dir.parent
    args = [a.format(run=run_dir, tmp=tmp) for a in argv]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
