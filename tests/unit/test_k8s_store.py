"""``unbroken k8s store``: the store pod's process serves a TCPStore and stops on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from procs import worker_env


@pytest.mark.slow
def test_store_serves_clients_and_exits_0_on_sigterm() -> None:
    import torch.distributed as dist

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unbroken.cli",
            "k8s",
            "store",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:
            m = re.search(r"serving on port (\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "the store never said where it serves"
        a = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        b = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        a.set("k", "v")
        assert b.get("k") == b"v" and b.add("n", 2) == 2
        del a, b
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
