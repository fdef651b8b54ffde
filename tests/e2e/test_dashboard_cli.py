"""Bad input to ``unbroken dashboard`` and ``unbroken-run --ft-metrics-port``: one clear line and
exit code 2, never a traceback."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from procs import run, unbroken_run_cmd
from unbroken.launcher import config as lconfig


def _dashboard(*args: str):
    return run([sys.executable, "-m", "unbroken.cli", "dashboard", *args], timeout_s=60)


def test_missing_path_bad_config_and_port_in_use(tmp_path: Path) -> None:
    res = _dashboard(str(tmp_path / "nope"))
    assert res.returncode == 2 and "does not exist" in res.output and "Traceback" not in res.output
    (tmp_path / "a.yaml").write_text("page_after: 3\n")
    res = _dashboard(str(tmp_path), "--alerts", str(tmp_path / "a.yaml"))
    assert res.returncode == 2 and "unknown alert settings" in res.output
    res = _dashboard(str(tmp_path), "--webhook", "not-a-url")
    assert res.returncode == 2 and "--webhook must be an http(s) URL" in res.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _dashboard(str(tmp_path), "--port", str(port))
        assert res.returncode == 2 and "Traceback" not in res.output
        assert (
            f"cannot listen on 127.0.0.1:{port}" in res.output
            and "pick another --port" in res.output
        )
        res = run(
            unbroken_run_cmd(
                tmp_path / "r", nproc=1, steps=3, launcher_args=["--ft-metrics-port", str(port)]
            ),
            timeout_s=60,
        )
        # Another process holds the port on 127.0.0.1, where a standalone job's /metrics listens.
        assert res.returncode == 2, res.output
        assert f"cannot serve /metrics on 127.0.0.1:{port}" in res.output
        assert "Traceback" not in res.output


def test_metrics_port_is_checked_with_the_other_options() -> None:
    assert lconfig.LauncherConfig().metrics_port is None
    assert lconfig.coerce("metrics_port", "9400", source="--ft-metrics-port") == 9400
    with pytest.raises(ValueError, match="metrics_port must be a TCP port"):
        lconfig.LauncherConfig(metrics_port=70000)
    with pytest.raises(ValueError, match="--ft-metrics-port: metrics_port must be an int"):
        lconfig.coerce("metrics_port", "http", source="--ft-metrics-port")


def test_bench_dashboard_refresh_cost_runs(tmp_path: Path) -> None:
    """The benchmark's refresh part on a small synthetic run (its figures are not asserted)."""
    out = tmp_path / "cost.json"
    res = run(
        [
            sys.executable,
            "-m",
            "unbroken.cli",
            "bench",
            "dashboard",
            "--skip-job",
            "--long-steps",
            "600",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        timeout_s=120,
    )
    assert res.returncode == 0, res.output
    import json

    cost = json.loads(out.read_text())["refresh"]
    assert cost["records"] > 1200
    for key in ("report_full_s", "dashboard_first_load_s", "refresh_after_a_step_s"):
        assert cost[key] > 0
