"""Shared by every test: the tier markers, and no child processes or unbroken threads left behind.

Tiers come from the directory (``unit``, ``distributed``, ``e2e``: ``pytest -m unit``); a test
marks itself ``slow`` (a unit test that starts processes or takes seconds: not in
``make test-fast``), ``browser`` (drives Chromium) or ``serial`` (measures time or CPU shares, so
runs alone, after the parallel part of ``make test``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import children, launchpad_pid, route_pods  # noqa: E402

route_pods()  # the emulated pods' agents start from the launch server too

TESTS = Path(__file__).parent
TIERS = ("unit", "distributed", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture(autouse=True)
def no_leaks():
    before_children = set(children(os.getpid()))
    before_threads = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        pad = launchpad_pid()  # the launch server stays; its launches must not
        leaked = set(children(os.getpid())) - before_children - {pad}
        if pad is not None:
            leaked |= set(children(pad))
        threads = [
            t
            for t in threading.enumerate()
            if t.ident not in before_threads and t.name.startswith("unbroken")
        ]
        if not leaked and not threads:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"test leaked child processes {sorted(leaked)}"
    assert not threads, f"test leaked threads {[t.name for t in threads]}"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("8m")``: a fresh tmpfs of that size under tmp_path (real storage that fills up
    or turns read-only), unmounted at teardown. Needs root (CAP_SYS_ADMIN), as CI has."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, f"cannot mount a tmpfs (needs root): {res.stderr}"
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
