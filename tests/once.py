"""A module fixture's result computed once per test run, shared by its processes (``pytest -n``).

A module's fault-free reference run is deterministic: the same command gives the same hash in
every test process of a run. Under xdist every process that runs one of the module's tests
sets up its module fixtures again; ``once`` computes the result in the first, under a file
lock, and the others read it (JSON: a tuple comes back as a list). Results live beside the
processes' base temporary directories, so a new run computes them again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def once(request: pytest.FixtureRequest, compute: Callable[[], T]) -> T:
    """``compute()`` in the first test process of this run that needs the fixture of
    ``request``; its JSON result in the others (they wait for it)."""
    key = f"{request.node.nodeid}::{request.fixturename}"
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    result = shared / f"once-{name}.json"
    with open(shared / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, also if compute() fails
        if result.exists():
            return json.loads(result.read_text())["value"]
        value = compute()
        tmp = result.with_name(f"{result.name}.tmp")
        tmp.write_text(json.dumps({"key": key, "value": value}))
        os.replace(tmp, result)
        return value
