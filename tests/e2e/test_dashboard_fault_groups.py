"""The run page's recovery figures per fault class and per phase, and its checkpoint storage
warning, in headless Chromium, over hand-built ledgers: the page shows what the report says."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from timelines import faulty_run, rec, steps, write
from unbroken.dashboard.runs import RunSet
from unbroken.dashboard.server import DashboardServer
from unbroken.ledger import events as ev
from unbroken.ledger import read_events
from unbroken.ledger.goodput import compute

pytestmark = pytest.mark.browser  # Debian's Chromium (make test-browser)

CHROMIUM = "/usr/bin/chromium"


def test_run_page_shows_recovery_per_class_and_phase(tmp_path: Path) -> None:
    assert shutil.which("chromium") or Path(CHROMIUM).exists(), (
        "Debian's chromium is required (make test installs it)"
    )
    from playwright.sync_api import sync_playwright

    write(tmp_path / "a", faulty_run())
    exc = compute(read_events(tmp_path / "a")).by_class["exception"]
    runs = RunSet(tmp_path, refresh_s=0.05, record_alerts=False)
    server = DashboardServer(runs, port=0, kb_path=tmp_path / "kb.sqlite")
    runs.start()
    server.start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--headless", "--no-sandbox", "--disable-gpu"],
            )
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1600})
                page.goto(server.url.rstrip("/") + "/run/a")
                rows = page.locator("#by-class tr")
                rows.nth(1).wait_for(timeout=20_000)
                assert rows.count() == 2  # header + exception
                cells = rows.nth(1).inner_text().split("\t")
                assert cells[:3] == ["exception", "3", "3 (100.0%)"]
                assert cells[3] == (
                    f"{exc.recovery_s_p50:.2f} / {exc.recovery_s_p95:.2f} / "
                    f"{exc.recovery_s_max:.2f}"
                )
                assert cells[5] == f"{exc.steps_lost} ({exc.steps_lost_max}, 6.7)"
                phases = page.locator("#by-phase tr")
                assert phases.count() == 2 and phases.nth(1).inner_text().startswith("step\t3")
                fault = page.locator("#faults tr").nth(1).inner_text().split("\t")
                assert fault[2:4] == ["exception", "step"]  # class, phase
            finally:
                browser.close()
    finally:
        server.close()
        runs.close()


def test_run_page_warns_while_checkpoint_storage_fails(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    enospc = "OSError: [Errno 28] No space left on device"
    failing = [
        *steps(0, 19, 0.0),
        rec(ev.CKPT_COMMIT, 5.5, step=4),
        rec(ev.CKPT_FAIL, 10.5, step=9, error=enospc),
    ]
    write(tmp_path / "failing", failing)
    write(tmp_path / "recovered", [*failing, rec(ev.CKPT_COMMIT, 15.5, step=14)])
    runs = RunSet(tmp_path, refresh_s=0.05, record_alerts=False)
    server = DashboardServer(runs, port=0, kb_path=tmp_path / "kb.sqlite")
    runs.start()
    server.start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--headless", "--no-sandbox", "--disable-gpu"],
            )
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1600})
                page.goto(server.url.rstrip("/") + "/run/failing")
                warning = page.locator("#storage-failing")
                warning.wait_for(state="visible", timeout=20_000)
                text = warning.inner_text()
                assert text.startswith("Checkpoint storage failing for ")
                assert "1 save(s) failed" in text and enospc in text
                assert "newest: step 4" in text and "memory tier" in text
                row = page.locator("#checkpoint tr", has_text="unprotected").inner_text()
                assert row.split("\t")[1] == "9.5 s (1)"  # 10.5 to the newest record, 20
                page.goto(server.url.rstrip("/") + "/run/recovered")
                row = page.locator("#checkpoint tr", has_text="unprotected")
                row.wait_for(timeout=20_000)
                assert row.inner_text().split("\t")[1] == "5.0 s (1)"
                assert page.locator("#storage-failing").is_hidden()
            finally:
                browser.close()
    finally:
        server.close()
        runs.close()
