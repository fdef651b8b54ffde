"""node-loss: a whole process tree dies at once; the emulated orchestrator brings the node back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unbroken.bench.orchestrator import OrchestratorConfig, run_node
from unbroken.ledger import read_events

SRC = Path(__file__).parents[2] / "src"

# A worker: fires node-loss after step 0 (the agent pid, if any, from the launcher's env).
WORKER = """
import subprocess, sys, time
from unbroken.env import WorkerEnv
from unbroken.faults import FaultInjector, parse_plan
from unbroken.ledger import Ledger
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its writer
open(sys.argv[2], "w").write(str(child.pid))
plan = parse_plan({"faults": [{"step": 0, "rank": 0, "kind": "node-loss"}]})
ledger = Ledger(sys.argv[1], run="r", rank=0)
FaultInjector(plan, run_dir=sys.argv[1], rank=0, sink=ledger,
              agent_pid=WorkerEnv.from_environ().agent_pid).on_step(0)
print("survived")
"""

# A launcher agent (its command line says torchrun, for the detection by the parent's name):
# starts the worker and a peer with a child of its own, records their pids, waits.
AGENT = """# a fake torchrun agent
import json, os, subprocess, sys, time
run_dir = sys.argv[1]
env = dict(os.environ)
if sys.argv[2] == "env":
    env["UNBROKEN_AGENT_PID"] = str(os.getpid())
peer = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(600)']); time.sleep(600)"])
time.sleep(0.3)  # the peer's child exists before the worker looks
worker = subprocess.Popen([sys.executable, "-c", sys.argv[3], run_dir, run_dir + "/writer.pid"],
                          env=env)
json.dump({"peer": peer.pid, "worker": worker.pid}, open(run_dir + "/pids.json", "w"))
worker.wait()
print("agent survived", flush=True)
time.sleep(600)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("UNBROKEN_AGENT_PID", "TORCHELASTIC_RUN_ID")
    }
    env["PYTHONPATH"] = str(SRC)
    env.update(extra)
    return env


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.02)
    return alive


def _descendants_of(pid: int) -> list[int]:
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            table[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in table.items() if pp == parent]
        out += kids
        todo += kids
    return out


@pytest.mark.parametrize("found_by", ["env", "parent"])
def test_the_agent_and_every_process_below_it_die_at_once(tmp_path: Path, found_by: str) -> None:
    env = _env(TORCHELASTIC_RUN_ID="job") if found_by == "parent" else _env()
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), found_by, WORKER],
        env=env,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids.json").exists() or not (tmp_path / "writer.pid").exists():
            assert agent.poll() is None and time.monotonic() < deadline
            tree = _descendants_of(agent.pid)
            time.sleep(0.02)
        assert agent.wait(timeout=60) == -signal.SIGKILL
        assert b"survived" not in agent.stdout.read()
        pids = json.loads((tmp_path / "pids.json").read_text())
        writer = int((tmp_path / "writer.pid").read_text())
        assert _wait_gone([*tree, pids["peer"], pids["worker"], writer]) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait()
        agent.stdout.close()
    (event,) = [e for e in read_events(tmp_path) if e.kind == "fault_injected"]
    assert event.get("scope") == "agent" and event.get("found_by") == found_by
    assert event.get("agent_pid") == agent.pid
    assert {pids["peer"], writer} <= set(event.get("pids"))
    assert pids["worker"] not in event.get("pids")  # it kills itself last


def test_without_a_launcher_only_the_process_and_its_children_die(tmp_path: Path) -> None:
    parent = textwrap.dedent(
        """
        import subprocess, sys
        code = subprocess.call([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
        print("parent alive, child", code)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", parent, WORKER, str(tmp_path), str(tmp_path / "writer.pid")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"parent alive, child {-signal.SIGKILL}" in proc.stdout
    writer = int((tmp_path / "writer.pid").read_text())
    try:
        assert _wait_gone([writer]) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(writer, signal.SIGKILL)
    (event,) = [e for e in read_events(tmp_path) if e.kind == "fault_injected"]
    assert event.get("scope") == "process" and event.get("agent_pid") is None
    assert event.get("pids") == [writer]


# --- the emulated Kubernetes Job replacing a lost node's pod ---------------------------------------
LAUNCHER = """
import json, os, signal, sys, time
from pathlib import Path
run_dir, mode = Path(sys.argv[1]), sys.argv[2]
fired = run_dir / "faults" / "fired"
fired.mkdir(parents=True, exist_ok=True)
launches = len(list(run_dir.glob("launch-*")))
(run_dir / f"launch-{launches}").touch()
print("launch", launches, flush=True)
if launches == 0 or (mode == "twice" and launches == 1):
    if mode != "no-claim":
        claim = {"index": launches, "step": 3, "rank": 1, "kind": "node-loss", "ts": time.time()}
        (fired / f"{launches}.json").write_text(json.dumps(claim))
    os.kill(os.getpid(), signal.SIGKILL)
print("done", flush=True)
"""


def _node(tmp_path: Path, mode: str, **cfg: float) -> tuple:
    lines: list[str] = []
    res = run_node(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), mode],
        run_dir=tmp_path,
        cfg=OrchestratorConfig(nproc=1, restart_delay_s=0.05, job_timeout_s=60, **cfg),
        env=_env(),
        on_line=lines.append,
    )
    return res, lines


def test_a_lost_node_is_relaunched_after_the_pod_restart_delay(tmp_path: Path) -> None:
    t0 = time.monotonic()
    res, lines = _node(tmp_path, "twice")
    assert res.returncode == 0 and res.launches == 3
    assert time.monotonic() - t0 >= 0.05 + 0.1  # the Job controller's back-off: 0.05 s, 0.1 s
    assert lines.count("done\n") == 1 and "launch 2\n" in res.output
    events = [e for e in read_events(tmp_path) if e.rank == -1]
    kinds = [(e.kind, e.attempt) for e in events]
    assert kinds == [
        ("fault_detected", 0),
        ("restart_begin", 0),
        ("restart_end", 1),
        ("fault_detected", 1),
        ("restart_begin", 1),
        ("restart_end", 2),
    ]
    detected = events[0]
    assert (detected.get("detector"), detected.get("layer"), detected.get("cause")) == (
        "orchestrator",
        "orchestrator",
        "node-loss",
    )
    assert detected.get("fault_rank") == 1 and detected.get("exit_code") == 128 + signal.SIGKILL
    assert [e.get("delay_s") for e in events if e.kind == "restart_begin"] == [0.05, 0.1]


def test_a_launcher_killed_without_node_loss_is_not_relaunched(tmp_path: Path) -> None:
    res, _ = _node(tmp_path, "no-claim")
    assert (res.returncode, res.launches) == (128 + signal.SIGKILL, 1)
    assert not (tmp_path / "events").exists()  # the orchestrator had nothing to record


def test_relaunches_stop_at_max_restarts(tmp_path: Path) -> None:
    res, _ = _node(tmp_path, "twice", max_restarts=1)
    assert (res.returncode, res.launches) == (128 + signal.SIGKILL, 2)
    ends = [e for e in read_events(tmp_path) if e.kind == "job_end"]
    assert [e.get("status") for e in ends] == ["failed"]
