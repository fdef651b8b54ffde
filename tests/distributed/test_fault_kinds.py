"""Fault kinds that need a real process group."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from procs import worker_env

_WORKER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from unbroken.faults import FaultInjector, parse_plan
    rank, port, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(1))
    plan = parse_plan({"faults": [{"step": 0, "rank": 1, "kind": "hang-collective"}]})
    print("ready", flush=True)
    FaultInjector(plan, run_dir=run_dir, rank=rank).on_step(0)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, which never comes
    print("returned", flush=True)
    """
)


def test_hang_collective_blocks_in_gloo_until_the_peer_goes(tmp_path: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(r), str(store.port), str(tmp_path)],
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        fired = tmp_path / "faults" / "fired" / "0.json"
        deadline = time.monotonic() + 60
        while not fired.exists():
            assert time.monotonic() < deadline, "the fault never fired"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.02)
        time.sleep(0.5)
        assert [p.poll() for p in procs] == [None, None]  # both blocked
        procs[0].send_signal(signal.SIGKILL)  # the peer goes: its connections close
        out1, _ = procs[1].communicate(timeout=30)
        assert procs[1].returncode not in (0, None)  # the receive failed instead of hanging
        assert "returned" not in out1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            if p.stdout:
                p.stdout.close()
