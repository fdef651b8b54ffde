"""The reference script's flags: every value is parsed into a valid one or refused with
argparse's usage error (exit 2; under a launcher exit 78, EXIT_CONFIG, so that unbroken-run
does not restart it), and flags that contradict the world or name no model size end the script
with EXIT_CONFIG, not a traceback and a restart."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procs import run
from unbroken.errors import EXIT_CONFIG
from unbroken.workload import flags, train

NUMERIC = [
    "--steps",
    "--batch-size",
    "--global-batch",
    "--seq-len",
    "--seed",
    "--lr",
    "--num-samples",
    "--pg-timeout-s",
    "--log-every",
    "--soft-timeout-s",
    "--hard-timeout-s",
    "--max-rank-faults",
    "--ckpt-every",
    "--ckpt-keep",
]
values = st.one_of(
    st.sampled_from(["0", "-1", "1", "nan", "inf", "-inf", "1e309", "1.5", "", "²", "--5"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.text(max_size=5),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(NUMERIC), values), max_size=4))
@pytest.mark.slow
def test_numeric_flags_parse_or_exit_2(pairs: list[tuple[str, str]]) -> None:
    argv = [f"{flag}={value}" for flag, value in pairs]
    try:
        args = train.build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return
    for name, value in vars(args).items():
        if isinstance(value, float):
            assert math.isfinite(value) and value > 0, name
        elif isinstance(value, int) and not isinstance(value, bool):
            assert value >= 0, name
    with contextlib.suppress(ValueError):
        flags.check_args(args, world_size=2)


def test_a_usage_error_under_a_launcher_exits_with_the_config_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "-1"])
    assert e.value.code == 2
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(SystemExit) as e:
        train.main(["--lr", "nan"])
    assert e.value.code == EXIT_CONFIG


@pytest.mark.slow
def test_flags_that_contradict_each_other_end_the_script_with_the_config_code(
    tmp_path: Path,
) -> None:
    """In a subprocess: the script's ledger flusher is a thread of its process."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults: [{step: 1, rank: 5, kind: sigkill}]\n")
    cmd = [sys.executable, "-m", "unbroken.workload.train", "--run-dir", str(tmp_path)]
    res = run([*cmd, "--model", "colossal", "--faults", str(plan)], timeout_s=120)
    assert res.returncode == EXIT_CONFIG, res.output[-2000:]
    assert "unknown model size 'colossal'" in res.output and "Traceback" not in res.output
