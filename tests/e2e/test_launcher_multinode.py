"""Two agents on loopback as two nodes: one agent dies, the other re-rendezvouses and the job
goes on when a replacement agent joins, ending with a fault-free run's weights."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from procs import run, unbroken_run_cmd, worker_env
from unbroken.ledger import read_events
from unbroken.ports import spare_port

STEPS = 40
BATCH = ["--batch-size", "4", "--no-inprocess"]  # the launcher's recovery, not in-process
HASH = re.compile(r"final_state_sha256=([0-9a-f]{64})")


def _agent(run_dir: Path, port: int, *, host: bool, log: Path) -> subprocess.Popen[bytes]:
    conf = (
        f"keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=10,is_host={int(host)}"
    )
    cmd = unbroken_run_cmd(
        run_dir,
        nproc=1,
        steps=STEPS,
        extra=BATCH,
        standalone=False,
        launcher_args=[
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes",
            "--rdzv-conf",
            conf,
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "3",
        ],
    )
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, env=worker_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _worker_at(run_dir: Path, rank: int, step: int) -> int | None:
    """pid of ``rank`` in round 0 once it completed ``step``."""
    pid, reached = None, False
    for f in (run_dir / "events").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec["rank"] == rank and rec["attempt"] == 0:
                    pid = rec["pid"] if rec["kind"] == "process_start" else pid
                    reached = reached or (rec["kind"] == "step" and rec["step"] >= step)
    return pid if reached else None


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_agent_loss_then_replacement_continues_the_job(tmp_path: Path) -> None:
    ref = run(unbroken_run_cmd(tmp_path / "ref", nproc=2, steps=STEPS, extra=BATCH), timeout_s=180)
    assert ref.returncode == 0, ref.output[-3000:]
    expected = ref.hashes()[0]

    run_dir, port = tmp_path / "job", spare_port()
    run_dir.mkdir()
    logs = {n: tmp_path / f"{n}.log" for n in "abc"}
    procs = {"a": _agent(run_dir, port, host=True, log=logs["a"])}
    try:
        time.sleep(0.5)  # let A host the rendezvous store
        procs["b"] = _agent(run_dir, port, host=False, log=logs["b"])
        deadline = time.monotonic() + 120
        b_worker = None
        while b_worker is None or _worker_at(run_dir, 0, 2) is None:
            assert time.monotonic() < deadline, logs["b"].read_text()[-2000:]
            assert procs["a"].poll() is None, logs["a"].read_text()[-2000:]
            time.sleep(0.02)
            b_worker = _worker_at(run_dir, 1, 2)
        procs["b"].kill()  # the node's agent dies; its worker must die with it
        procs["c"] = _agent(run_dir, port, host=False, log=logs["c"])
        deadline = time.monotonic() + 10
        while not _gone(b_worker):
            assert time.monotonic() < deadline, "the dead agent's worker outlived it"
            time.sleep(0.05)
        for name in ("a", "c"):
            procs[name].wait(timeout=180)
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = {n: logs[n].read_text() for n in "ac"}
    assert procs["a"].returncode == 0, out["a"][-3000:]
    assert procs["c"].returncode == 0, out["c"][-3000:]
    assert HASH.findall(out["a"]) == [expected] and HASH.findall(out["c"]) == [expected]
    events = read_events(run_dir)
    rounds = {
        e.get("round")
        for e in events
        if e.rank == -1
        and e.kind == "phase"
        and e.get("name") == "rendezvous"
        and e.get("group_world_size") == 2
    }
    assert len(rounds) >= 2  # the first round, and the one with the replacement
