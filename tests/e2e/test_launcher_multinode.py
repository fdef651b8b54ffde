"""Two agents on loopback as two nodes: one agent dies, the other re-rendezvouses and the job
goes on when a replacement agent joins, ending with a fault-free run's weights. The same with
the rendezvous store in a process of its own (the store pod) that is killed and replaced first."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from once import once
from procs import popen, run, unbroken_run_cmd, worker_env
from unbroken.ledger import read_events
from unbroken.ports import spare_port

STEPS = 80  # the store's loss is noticed and re-joined in 1-3 s (keep-alives of 1 s) while
# training goes on at ~0.1 s a step: the node's loss must still come before the end
BATCH = ["--batch-size", "4", "--no-inprocess"]  # the launcher's recovery, not in-process
REJOINED = "re-joined the rendezvous store"
HASH = re.compile(r"final_state_sha256=([0-9a-f]{64})")


@pytest.fixture(scope="module")
def expected(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """final_state_sha256 of the same training, fault-free, 2 ranks on one node."""

    def compute() -> str:
        ref_dir = tmp_path_factory.mktemp("ref")
        ref = run(unbroken_run_cmd(ref_dir, nproc=2, steps=STEPS, extra=BATCH), timeout_s=180)
        assert ref.returncode == 0, ref.output[-3000:]
        return ref.hashes()[0]

    return once(request, compute)


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
        return popen(
            cmd, env=worker_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@contextlib.contextmanager
def _processes() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The test's processes by name; every one's process group is killed at the end."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        yield procs
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


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


def test_agent_loss_then_replacement_continues_the_job(expected: str, tmp_path: Path) -> None:
    run_dir, port = tmp_path / "job", spare_port()
    run_dir.mkdir()
    logs = {n: tmp_path / f"{n}.log" for n in "abc"}
    with _processes() as procs:
        procs["a"] = _agent(run_dir, port, host=True, log=logs["a"])
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


def _store(port: int, log: Path) -> subprocess.Popen[bytes]:
    """The rendezvous store's process, as the store pod runs it; returns once it serves."""
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "store", "--host", "127.0.0.1"]
    with open(log, "wb") as out:
        proc = popen(
            [*cmd, "--port", str(port)],
            env=worker_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while "serving on port" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.02)
    return proc


def _newest_step(run_dir: Path) -> int:
    """The highest step any rank completed, in any round."""
    newest = -1
    for f in (run_dir / "events").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                rec = json.loads(line)
                if rec["kind"] == "step":
                    newest = max(newest, int(rec["step"]))
    return newest


def _wait_step(run_dir: Path, step: int, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while _newest_step(run_dir) < step:
        assert time.monotonic() < deadline, f"no rank reached step {step}"
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited {p.returncode}"
        time.sleep(0.02)


def test_the_store_lost_and_replaced_then_a_node_lost_the_job_continues(
    expected: str, tmp_path: Path
) -> None:
    """No single point of failure: the store process is killed while the job trains and a
    new, empty one takes its port (what a Deployment does); training goes on meanwhile; then a
    node is lost and replaced. The agents re-joined the new store with what it needs (torch's
    rendezvous state, the round counter), so that fault is recovered like any other."""
    run_dir, port = tmp_path / "job", spare_port()
    run_dir.mkdir()
    logs = {n: tmp_path / f"{n}.log" for n in ("store", "store2", "a", "b", "c")}
    with _processes() as procs:
        procs["store"] = _store(port, logs["store"])
        procs["a"] = _agent(run_dir, port, host=False, log=logs["a"])
        procs["b"] = _agent(run_dir, port, host=False, log=logs["b"])
        _wait_step(run_dir, 5, procs)
        lost = procs.pop("store")
        lost.kill()  # the store pod is lost: its state with it
        lost.wait()
        time.sleep(0.3)
        procs["store"] = _store(port, logs["store2"])  # its replacement: empty, same address
        deadline = time.monotonic() + 60
        while not all(REJOINED in logs[n].read_text() for n in "ab"):
            assert time.monotonic() < deadline, logs["a"].read_text()[-3000:]
            time.sleep(0.02)
        _wait_step(run_dir, _newest_step(run_dir) + 5, procs)  # training went on
        procs["b"].kill()  # then a node is lost (its worker dies with its agent)
        procs["c"] = _agent(run_dir, port, host=False, log=logs["c"])
        for name in ("a", "c"):
            procs[name].wait(timeout=180)
    out = {n: logs[n].read_text() for n in logs}
    assert procs["a"].returncode == 0, out["a"][-3000:]
    assert procs["c"].returncode == 0, out["c"][-3000:]
    # The store's loss restarted nothing; the node's loss, once.
    assert "all workers finished (1 restarts)" in out["a"], out["a"][-3000:]
    assert HASH.findall(out["a"]) == [expected] and HASH.findall(out["c"]) == [expected]
    joined = [
        (e.get("round"), e.get("group_rank"))
        for e in read_events(run_dir)
        if e.rank == -1 and e.kind == "phase" and e.get("name") == "rendezvous"
    ]
    # Every round has its own id: the counter went on in the new store, it did not start over.
    assert len(joined) >= 4 and len(set(joined)) == len(joined), joined
