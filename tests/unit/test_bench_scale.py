"""``unbroken bench scale``: the fits name growth right, the stand-ins speak the real wire
format, and each curve's measurement runs small (the real agent, commit and report code)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.bench import scale, scale_commit, scale_heartbeat, scale_ledger
from unbroken.launcher.client import _Client


@pytest.mark.parametrize(
    ("power", "name"), [(0.0, "constant"), (1.0, "linear"), (2.0, "quadratic")]
)
def test_the_fit_names_the_growth(power: float, name: str) -> None:
    xs = [2.0**k for k in range(1, 9)]
    ys = [3e-4 * x**power for x in xs]
    f = scale.fit(xs, ys)
    assert f is not None and f["order"] == name
    assert f["slope"] == pytest.approx(power, abs=1e-6)
    if power:
        n = scale.size_at(xs, ys, f, 0.01)
        assert 3e-4 * n**power == pytest.approx(0.01, rel=1e-6)
    else:
        assert scale.size_at(xs, ys, f, 0.01) is None


def test_size_at_interpolates_inside_the_measured_range() -> None:
    xs, ys = [8.0, 64.0, 512.0], [0.001, 0.02, 0.1]
    n = scale.size_at(xs, ys, scale.fit(xs, ys), 0.01)
    assert 8 < n < 64
    assert scale.size_at([8.0, 16.0], [0.5, 1.0], None, 0.01) == "<8"


def test_the_stand_in_heartbeat_is_the_clients_datagram() -> None:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    try:
        client = _Client(rx.getsockname(), rank=3, local_rank=3, round_=0, interval_s=0.0)
        client.send(7, None)
        real = json.loads(rx.recv(4096))
        client.sock.close()
    finally:
        rx.close()
    ours = json.loads(scale_heartbeat.datagram(rank=3, step=7))
    assert set(ours) == set(real)
    assert {k: v for k, v in ours.items() if k not in ("pid", "ts")} == {
        k: v for k, v in real.items() if k not in ("pid", "ts")
    }


@pytest.mark.slow
def test_the_real_agent_detects_the_silent_stand_in() -> None:
    row = scale_heartbeat.measure(16, period_s=0.2, timeout_s=0.8)
    assert row["detected_right_rank"] and row["detected_ranks"] == [8]
    assert row["detection_latency_s"] >= 0.8
    assert 0 < row["received"] <= row["sent"]
    assert row["agent_cpu_s_per_s"] > 0


def test_commit_and_restore_listing_of_a_small_world() -> None:
    row = scale_commit.measure(4, tensors=3)
    assert row["metadata_bytes"] > 0 and row["merge_peak_bytes"] > 0
    assert row["merge_s"] > 0 and row["restore_listing_s"] > 0


def test_the_report_curve_checks_folded_against_unfolded() -> None:
    row = scale_ledger.measure(3, 200)
    assert row["records"] > 600
    assert row["unfolded_report_s"] > 0 and row["report_memory_bytes"] > 0


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_the_spawn_curve_starts_workers_from_the_warm_pool_and_cold() -> None:
    # In a child interpreter: the curve makes its process a subreaper (as the agent is).
    code = (
        "import json; from unbroken.bench import scale_spawn; "
        "print(json.dumps(scale_spawn.measure(2, trials_warm=2, trials_standby=2, "
        "trials_cold=1)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["workers"] == 2
    assert len(row["warm_trials"]) == 2 and len(row["cold_trials"]) == 1
    assert len(row["standby_trials"]) == 2  # every worker of those trials was a standby
    assert row["warm_spawn_s"] > 0 and row["standby_spawn_s"] > 0 and row["cold_spawn_s"] > 0


def test_main_prints_the_table_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(scale.SIZES, "commit", ([2, 4, 8, 16], [2, 4, 8, 16]))
    out = tmp_path / "scale.json"
    args = argparse.Namespace(quick=True, curves=["commit"], report_steps=None, json=str(out))
    assert scale.main(args) == 0
    text = capsys.readouterr().out
    assert "merge_s" in text and "load average" in text
    doc = json.loads(out.read_text())
    assert [r["ranks"] for r in doc["curves"]["commit"]] == [2, 4, 8, 16]
    metrics = {s["metric"]: s for s in doc["summary"]}
    assert metrics["merge_s"]["fit"]["order"]
