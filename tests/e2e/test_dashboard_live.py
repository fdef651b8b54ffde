"""A real training job under unbroken-run with faults, watched while it runs: the dashboard in
headless Chromium, the launcher's /metrics, and after the end /metrics against unbroken report."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from procs import popen, run, unbroken_run_cmd, worker_env

pytestmark = pytest.mark.browser  # Debian's Chromium (make test-browser)

CHROMIUM = "/usr/bin/chromium"
PLAN = """faults:
  - {step: 10, rank: 1, kind: exception}
  - {step: 25, rank: 1, kind: sigkill}
  - {step: 40, rank: 1, kind: exception}
"""


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _counters(text: str) -> dict[str, float]:
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for fam in text_string_to_metric_families(text)
        if fam.type == "counter"
        for s in fam.samples
    }


def _wait_for(pred, what, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_watch_a_live_job(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    run_dir = tmp_path / "job"
    run_dir.mkdir()
    (tmp_path / "plan.yaml").write_text(PLAN)
    dash = popen(
        [
            sys.executable,
            "-m",
            "unbroken.cli",
            "dashboard",
            str(run_dir),
            "--port",
            "0",
            "--refresh-s",
            "0.2",
            "--kb",
            str(tmp_path / "kb.sqlite"),
        ],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    log = open(tmp_path / "job.log", "w+")  # noqa: SIM115 (closed in the finally below)
    job = None
    try:
        line = _wait_for(dash.stdout.readline, "the dashboard's URL", 30)
        url = re.search(r"http://\S+/", line).group(0)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=[
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                ],
            )
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1800})
                # Chromium and its page start before the job: on a loaded machine that can take
                # longer than the job's 70 steps (seen in CI), and the page must see it running.
                cmd = unbroken_run_cmd(
                    run_dir,
                    nproc=2,
                    steps=70,
                    launcher_args=["--max-restarts", "3", "--ft-metrics-port", "0"],
                    extra=[
                        "--faults",
                        str(tmp_path / "plan.yaml"),
                        "--ckpt-every",
                        "5",
                        "--soft-timeout-s",
                        "2",
                        "--hard-timeout-s",
                        "6",
                    ],
                )
                job = popen(
                    cmd,
                    env=worker_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                port = _wait_for(
                    lambda: re.findall(
                        r"/metrics on http://[^:]+:(\d+)/", Path(log.name).read_text()
                    ),
                    "the launcher's /metrics port",
                    60,
                )[0]
                metrics_url = f"http://127.0.0.1:{port}/metrics"
                scrapes = [_counters(_get(metrics_url))]
                _wait_for(
                    lambda: json.loads(_get(url + "api/runs"))["runs"], "the run to appear", 60
                )
                page.goto(url + "run/job")
                chart = page.locator("#step-chart")

                def points() -> int:
                    return int(chart.get_attribute("data-points") or 0)

                _wait_for(lambda: points() >= 3, "steps on the chart", 90)
                first = points()
                _wait_for(
                    lambda: points() > first,
                    lambda: (
                        f"the step chart to grow past {first} points (it has {points()}, "
                        f"status {page.locator('#status').inner_text()!r}, job exit {job.poll()})"
                    ),
                    30,
                )
                assert page.locator("#status").inner_text() == "running"
                assert page.locator("#step-chart canvas").count() >= 1
                scrapes.append(_counters(_get(metrics_url)))

                rows = page.locator("#faults tr")
                _wait_for(lambda: rows.count() >= 2, "the first fault on the page", 90)
                assert "exception" in rows.nth(1).inner_text()
                _wait_for(
                    lambda: int(chart.get_attribute("data-fault-marks") or 0) >= 1,
                    "a fault mark on the chart",
                    30,
                )
                scrapes.append(_counters(_get(metrics_url)))
                page_alert = page.locator('li.alert.page[data-name="fault_recurring"]')
                _wait_for(lambda: page_alert.count() >= 1, "the recurring-fault alert", 120)
                assert "rank 1" in page_alert.first.inner_text()
                scrapes.append(_counters(_get(metrics_url)))
                assert job.wait(timeout=240) == 0, Path(log.name).read_text()[-3000:]
                _wait_for(lambda: page.locator("#status").inner_text() == "ok", "status ok", 30)
                assert rows.count() == 4  # header + three faults
                shot = page.screenshot(full_page=True)
            finally:
                browser.close()
        (tmp_path / "dashboard.png").write_bytes(shot)
        assert len(shot) > 20_000

        # The launcher's counters never went down, across its workers' restarts.
        for before, after in zip(scrapes, scrapes[1:], strict=False):
            for key, value in before.items():
                assert after.get(key, 0.0) >= value, key
        assert any("sigkill" in k and "launcher" in k for k in scrapes[-1])

        # After the end: a fresh scrape equals unbroken report on the same run.
        res = run(
            [sys.executable, "-m", "unbroken.cli", "report", str(run_dir), "--json", "-"],
            timeout_s=60,
        )
        assert res.returncode == 0, res.output
        rep = json.loads(res.output)
        from unbroken.dashboard.metrics import MetricsServer

        fresh = MetricsServer(run_dir, port=0, host="127.0.0.1")
        try:
            text = _get(f"http://127.0.0.1:{fresh.port}/metrics")
        finally:
            fresh.close()
        m = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                m[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run")))] = (
                    s.value
                )
        assert m[("unbroken_productive_seconds_total", ())] == pytest.approx(rep["productive_s"])
        assert m[("unbroken_wall_seconds_total", ())] == pytest.approx(rep["wall_s"])
        for cat, secs in rep["badput_s"].items():
            assert m[("unbroken_badput_seconds_total", (("category", cat),))] == pytest.approx(secs)
        assert m[("unbroken_steps_lost_total", ())] == sum(f["steps_lost"] for f in rep["faults"])
        restarts = {k[1]: v for k, v in m.items() if k[0] == "unbroken_restarts_total"}
        assert sum(restarts.values()) == len(rep["faults"]) == 3
        assert restarts[(("cause", "sigkill"), ("layer", "launcher"))] == 1
        assert m[("unbroken_recovery_seconds_count", ())] == 3
        assert m[("unbroken_steps_completed", ())] == rep["steps_completed"] == 70

        # The dashboard recorded its alerts in the run's ledger; the report is unchanged by them.
        alerts = json.loads(_get(url + "api/alerts"))
        assert {a["name"] for a in alerts} >= {"fault_recovered", "fault_recurring"}
        dash.send_signal(signal.SIGTERM)
        assert dash.wait(timeout=30) == 0
        recorded = [
            json.loads(line)
            for f in (run_dir / "events").glob("*.jsonl")
            for line in f.read_text().splitlines()
            if '"kind":"alert"' in line
        ]
        assert {r["key"] for r in recorded} == {a["key"] for a in alerts}
    finally:
        for proc in (job, dash):
            if proc is not None:
                _stop(proc)
        if dash.stdout:
            dash.stdout.close()
        log.close()
