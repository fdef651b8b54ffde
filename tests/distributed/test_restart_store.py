"""The coordination store as its own process: started, found, stopped, never leaked."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from procs import worker_env
from unbroken.restart.store import PID_KEY, StoreHost, spawn_server


def test_server_serves_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", worker_env())
    proc, port = spawn_server(timeout_s=60)
    host = StoreHost("127.0.0.1", port, server=proc)
    try:
        client = host.client(timeout_s=10)
        client.set("k", "v")
        assert host.client(timeout_s=10).get("k") == b"v"
        del client
    finally:
        host.close()
    assert proc.returncode == 0


def test_an_orphaned_server_outlives_its_parent_until_its_users_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "environ", worker_env())
    proc, port = spawn_server(timeout_s=60)
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        client = StoreHost("127.0.0.1", port, server=None).client(timeout_s=10)
        n = client.add("unbroken/store/npids", 1)
        client.set(PID_KEY.format(n), f"{os.uname().nodename}:{user.pid}")
        assert proc.stdin is not None
        proc.stdin.close()  # what the parent's death looks like to the server
        time.sleep(1.5)  # > 2 of its polls
        assert proc.poll() is None, "the server left while a registered process lived"
        user.kill()
        user.wait()
        proc.wait(timeout=30)
        assert proc.returncode == 0
    finally:
        for p in (user, proc):
            if p.poll() is None:
                p.kill()
                p.wait()
        if proc.stdout is not None:
            proc.stdout.close()
