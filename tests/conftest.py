"""Shared fixtures: every test must leave no child processes and no unbroken threads behind."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import children  # noqa: E402


@pytest.fixture(autouse=True)
def no_leaks():
    before_children = set(children(os.getpid()))
    before_threads = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = set(children(os.getpid())) - before_children
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
