"""Launch ranks of a worker script the way a launcher would, and collect what they say.

``store="agent"``: this process hosts the TCPStore at MASTER_ADDR:MASTER_PORT and hands its
address to the ranks as UNBROKEN_STORE_ADDR (what ``unbroken-run`` does). ``store="bare"``:
MASTER_PORT names a free port and nothing more; rank 0 serves the bootstrap store and starts
the coordination store process itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from procs import Launched, launchpad
from unbroken.ports import spare_port

WORKERS = Path(__file__).resolve().parent
SRC = WORKERS.parents[1] / "src"


@dataclass
class Rank:
    rank: int
    returncode: int
    output: str
    result: dict = field(default_factory=dict)

    @property
    def hashes(self) -> list[str]:
        return re.findall(r"final_state_sha256=([0-9a-f]{64})", self.output)


def launch(
    script: str,
    args: list[str],
    *,
    nproc: int = 2,
    store: str = "agent",
    timeout_s: float = 120.0,
    run_id: str = "test",
) -> list[Rank]:
    """Run ``nproc`` ranks of ``tests/workers/<script>`` to completion."""
    import torch.distributed as dist

    server = None
    base = dict(os.environ)
    base["PYTHONPATH"] = str(SRC) + os.pathsep + base.get("PYTHONPATH", "")
    base.update(OMP_NUM_THREADS="1", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    base.update(MASTER_ADDR="127.0.0.1", UNBROKEN_RUN_ID=run_id, TORCH_CPP_LOG_LEVEL="ERROR")
    base.pop("UNBROKEN_STORE_ADDR", None)
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if store == "agent":
        server = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        base["MASTER_PORT"] = str(server.port)
        base["UNBROKEN_STORE_ADDR"] = f"127.0.0.1:{server.port}"
    else:
        base["MASTER_PORT"] = str(spare_port())
    pad = launchpad(base)
    procs: list[subprocess.Popen[str]] = []
    served: list[Launched] = []
    try:
        for r in range(nproc):
            env = dict(base, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0")
            if pad is not None:  # forked from the suite's launch server: no interpreter start
                rank = pad.start(args, env=env, cwd=Path.cwd(), module=str(WORKERS / script))
                served.append(rank)
                continue
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKERS / script), *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        ranks = []
        for r, s in enumerate(served):
            res = s.result(max(1.0, deadline - time.monotonic()))
            ranks.append(_rank(r, res.returncode, res.output))
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(q.pid, signal.SIGKILL)
                outs = [q.communicate()[0] for q in procs]
                raise AssertionError(
                    f"ranks timed out after {timeout_s}s:\n"
                    + "\n".join(f"--- rank {i}\n{o[-3000:]}" for i, o in enumerate(outs))
                ) from None
            ranks.append(_rank(r, p.returncode, out))
        return ranks
    finally:
        for s in served:
            s.close()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            if p.poll() is None:
                p.wait()
        del server


def _rank(r: int, returncode: int, out: str) -> Rank:
    m = re.search(r"^WORKER_RESULT (.*)$", out, re.M)
    return Rank(r, returncode, out, json.loads(m.group(1)) if m else {})


def describe(ranks: list[Rank]) -> str:
    return "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.output[-4000:]}" for r in ranks)
