"""Failure causes and categories, and the launcher's error file."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from unbroken.launcher import errors
from unbroken.launcher.errors import Failure


@pytest.mark.parametrize(
    ("kwargs", "cause", "category"),
    [
        ({"signum": signal.SIGKILL}, "sigkill", "infra"),
        ({"signum": signal.SIGKILL, "oom_killed": True}, "oom-kill", "platform"),
        ({"signum": signal.SIGSEGV}, "segfault", "platform"),
        ({"signum": signal.SIGABRT}, "sigabrt", "platform"),
        ({"signum": signal.SIGTERM}, "sigterm", "infra"),
        ({"signum": signal.SIGUSR1}, "signal:SIGUSR1", "infra"),
        ({"exit_code": 1, "error_message": "ValueError: x"}, "exception", "user"),
        ({"exit_code": 3}, "exit_code", "user"),
        ({"exit_code": 137}, "sigkill", "infra"),
    ],
)
def test_classify_exit(kwargs: dict, cause: str, category: str) -> None:
    args = {"exit_code": None, "signum": None, "error_message": None, "oom_killed": False}
    args.update(kwargs)
    got = errors.classify_exit(**args)
    assert got[:2] == (cause, category)


def test_read_worker_error_reads_elastic_error_files(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    assert errors.read_worker_error(path) is None
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: boom",
                    "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"},
                }
            }
        )
    )
    assert errors.read_worker_error(path) == "RuntimeError: boom\nTraceback ..."


def test_error_file_names_the_first_failure_by_time(tmp_path: Path) -> None:
    later = Failure(
        rank=0,
        local_rank=0,
        cause="exception",
        category="user",
        detector="exit",
        ts=20.0,
        exit_code=1,
        message="RuntimeError: peer gone",
    )
    first = Failure(
        rank=1,
        local_rank=1,
        cause="sigkill",
        category="infra",
        detector="exit",
        ts=10.0,
        signal="SIGKILL",
        pid=42,
    )
    path = tmp_path / "sub" / "error.json"
    errors.write_error_file(
        path,
        exit_code=errors.EXIT_BUDGET_EXHAUSTED,
        failures=[later, first],
        restarts=3,
        run_id="r",
    )
    rec = json.loads(path.read_text())
    assert (rec["rank"], rec["cause"], rec["category"], rec["signal"]) == (
        1,
        "sigkill",
        "infra",
        "SIGKILL",
    )
    assert rec["reason"] == "restart_budget_exhausted" and rec["restarts"] == 3
    assert [f["rank"] for f in rec["failures"]] == [1, 0]
    for key in ("rank", "cause", "category", "exit_code", "signal", "ts", "message"):
        assert key in rec


def test_bad_category_and_oom_counter() -> None:
    with pytest.raises(ValueError):
        Failure(rank=0, local_rank=0, cause="x", category="cosmic", detector="exit", ts=0.0)
    count = errors.oom_kill_count()
    assert count is None or count >= 0
