"""The HTML report opens in real headless Chromium and its charts draw marks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from procs import run
from unbroken.ledger.events import (
    FAULT_DETECTED,
    FAULT_INJECTED,
    JOB_END,
    PHASE,
    RESTART_END,
    STEP,
    Event,
)

pytestmark = pytest.mark.browser  # Debian's Chromium (make test-browser)

CHROMIUM = "/usr/bin/chromium"


def _write_run(run_dir: Path, *, fault: bool) -> None:
    events = [Event(kind=PHASE, ts=1.0, run=run_dir.name, data={"name": "import", "dur_s": 1.0})]
    t = 1.0
    plan = list(range(10)) + list(range(5 if fault else 10, 20))  # a rollback to step 5
    for i, s in enumerate(plan):
        t += 0.5
        events.append(Event(kind=STEP, ts=t, run=run_dir.name, data={"step": s, "dur_s": 0.5}))
        if fault and i == 9:
            events.append(
                Event(
                    kind=FAULT_INJECTED,
                    ts=t,
                    run=run_dir.name,
                    rank=1,
                    data={"fault": "sigkill", "step": 9, "index": 0},
                )
            )
            events.append(
                Event(
                    kind=FAULT_DETECTED,
                    ts=t + 0.1,
                    run=run_dir.name,
                    data={"cause": "RuntimeError", "detector": "exception"},
                )
            )
            t += 2.0
            events.append(
                Event(
                    kind=RESTART_END, ts=t, run=run_dir.name, attempt=1, data={"layer": "launcher"}
                )
            )
    events.append(Event(kind=JOB_END, ts=t + 0.2, run=run_dir.name, data={"status": "ok"}))
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "events" / "x.jsonl").write_text("".join(e.to_json() + "\n" for e in events))


def test_html_report_renders_in_chromium(tmp_path: Path) -> None:
    assert shutil.which("chromium") or Path(CHROMIUM).exists(), (
        "Debian's chromium is required (make test installs it)"
    )
    from playwright.sync_api import sync_playwright

    _write_run(tmp_path / "clean", fault=False)
    _write_run(tmp_path / "faulty", fault=True)
    out = tmp_path / "report.html"
    res = run(
        [
            sys.executable,
            "-m",
            "unbroken.cli",
            "report",
            str(tmp_path / "clean"),
            str(tmp_path / "faulty"),
            "--html",
            str(out),
        ],
        timeout_s=60,
    )
    assert res.returncode == 0, res.output
    text = out.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1400})
            page.goto(out.as_uri())
            assert page.title() == "unbroken goodput report"
            lines = page.locator("svg.step-chart polyline.series")
            assert lines.count() == 3  # the faulty run's line breaks at its restart
            for i in range(3):
                box = lines.nth(i).bounding_box()
                assert box is not None and box["width"] > 150 and box["height"] > 80
            assert page.locator("svg.step-chart .fault-mark").count() == 1
            segments = page.locator("svg.breakdown-chart rect.segment")
            assert segments.count() >= 4
            widths = [segments.nth(i).bounding_box()["width"] for i in range(segments.count())]
            assert sum(widths) > 1000  # two bars spanning most of the chart
            rows = page.locator("table.faults tr")
            assert rows.count() == 2  # header + one fault
            assert "sigkill" in rows.nth(1).inner_text()
            cells = rows.nth(1).locator("td")
            assert cells.nth(3).inner_text() == "crash" and cells.nth(4).inner_text() == "step"
            assert cells.nth(12).inner_text() == "5"  # steps lost
            by_class = page.locator("table.fault-groups.by-class tr")
            assert by_class.count() == 2  # header + the faulty run's crash
            assert by_class.nth(1).inner_text().split("\t")[:3] == ["faulty", "crash", "1"]
            assert page.locator("table.fault-groups.by-phase tr").count() == 2
            shot = page.screenshot(full_page=True)
        finally:
            browser.close()
    (tmp_path / "report.png").write_bytes(shot)
    assert len(shot) > 10_000  # a rendered page with charts, not a blank one
