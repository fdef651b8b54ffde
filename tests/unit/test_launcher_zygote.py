"""The warm pool forks a request's workers in parallel: every worker runs as the agent's child,
and none holds the pool's pipes of the workers forked before it. Run in a child interpreter
that is a subreaper, as the agent is (making pytest one would adopt other tests' orphans)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

_AGENT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from unbroken.launcher import bootstrap
    from unbroken.launcher.zygote import Zygote

    tmp = Path(sys.argv[1])
    n = int(sys.argv[2])
    assert bootstrap.set_child_subreaper()
    script = tmp / "worker.py"
    script.write_text(
        "import json, os, sys\\n"
        "fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))\\n"
        "out = {'pid': os.getpid(), 'ppid': os.getppid(), 'fds': fds}\\n"
        "open(sys.argv[1], 'w').write(json.dumps(out))\\n"
    )
    outs = [tmp / f"worker-{i}.json" for i in range(n)]
    pool = Zygote([sys.argv[3]], env=dict(os.environ))
    try:
        assert pool.wait_ready(60), "the warm pool did not come up"
        reqs = [
            {"kind": "script", "target": str(script), "args": [str(o)], "cwd": str(tmp),
             "env": dict(os.environ), "stdout": None, "stderr": None}
            for o in outs
        ]
        pids = pool.spawn(reqs, timeout_s=60)
        reaped = {}
        while len(reaped) < n:
            pid, status = os.wait()
            reaped[pid] = os.waitstatus_to_exitcode(status)
    finally:
        pool.close()
    print(json.dumps({
        "agent": os.getpid(),
        "forked": type(pool.proc).__name__ == "Forked",
        "pids": pids,
        "reaped": reaped,
        "workers": [json.loads(o.read_text()) for o in outs],
    }))
    """
)


def _run_agent(tmp_path: Path, code: str, *args: str) -> dict:
    """Run ``code`` as the agent (in a child interpreter); the JSON of its last line."""
    agent = tmp_path / "agent.py"
    agent.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(agent), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("preload", ["json", "csv"])
def test_a_requests_workers_are_the_agents_children_and_share_no_pipe(
    tmp_path: Path, n: int, preload: str
) -> None:
    """With ``json`` preloaded (the agent imported it) the pool is forked from the agent, with
    ``csv`` (not imported) it is a fresh interpreter: the workers are the same."""
    doc = _run_agent(tmp_path, _AGENT, str(n), preload)
    assert doc["forked"] is (preload == "json")
    workers = doc["workers"]
    assert sorted(w["pid"] for w in workers) == sorted(doc["pids"])
    assert len(set(doc["pids"])) == n
    assert all(w["ppid"] == doc["agent"] for w in workers)  # re-parented to the subreaper
    assert {int(p): c for p, c in doc["reaped"].items()} == {p: 0 for p in doc["pids"]}
    # Every worker has the same descriptors: the pipes of the workers forked before it (the
    # pool holds them until it has read every pid) stay behind.
    assert len({tuple(w["fds"]) for w in workers}) == 1, workers


_AGENT_STANDBY = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from unbroken.launcher import bootstrap
    from unbroken.launcher.zygote import Zygote

    tmp, n, kill_one = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "kill"
    me = os.getpid()
    assert bootstrap.set_child_subreaper()
    script = tmp / "worker.py"
    script.write_text(
        "import json, os, sys\\n"
        "from unbroken.env import standby_start\\n"
        "from unbroken.ledger import process_start_time\\n"
        "fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))\\n"
        "out = {'pid': os.getpid(), 'ppid': os.getppid(), 'fds': fds,\\n"
        "       'started': standby_start() or process_start_time()}\\n"
        "open(sys.argv[1], 'w').write(json.dumps(out))\\n"
    )

    def children():
        return {int(x) for x in Path(f"/proc/{me}/task/{me}/children").read_text().split()}

    def start(pool, r):
        outs = [tmp / f"worker-{r}-{i}.json" for i in range(n)]
        reqs = [{"kind": "script", "target": str(script), "args": [str(o)], "cwd": str(tmp),
                 "env": dict(os.environ), "stdout": None, "stderr": None} for o in outs]
        asked = time.time()
        pids = pool.spawn(reqs, timeout_s=60)
        reaped = {}
        while len(reaped) < n:
            pid, status = os.waitpid(-1, 0)
            if pid in pids:
                reaped[pid] = os.waitstatus_to_exitcode(status)
        return {"asked": asked, "pids": pids, "standby": pool.standby, "reaped": reaped,
                "workers": [json.loads(o.read_text()) for o in outs]}

    pool = Zygote(["json", "unbroken.ledger"], env=dict(os.environ))
    try:
        assert pool.wait_ready(60), "the warm pool did not come up"
        first = start(pool, 0)
        deadline = time.monotonic() + 30  # the standbys: the agent's children but the pool
        while len(children() - {pool.pid}) < n:
            assert time.monotonic() < deadline, "no standbys"
            time.sleep(0.01)
        standbys = sorted(children() - {pool.pid})
        if kill_one:
            os.kill(standbys[0], signal.SIGKILL)
            os.waitpid(standbys[0], 0)
        second = start(pool, 1)
        deadline = time.monotonic() + 30  # and new standbys for the next restart
        while len(children() - {pool.pid}) < n:
            assert time.monotonic() < deadline, "no standbys after the restart"
            time.sleep(0.01)
    finally:
        pool.close()
    deadline = time.monotonic() + 30  # they end with the pool (EOF on their pipes)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        assert time.monotonic() < deadline
    print(json.dumps({"agent": me, "standbys": standbys, "first": first, "second": second}))
    """
)


@pytest.mark.parametrize("kill", ["none", "kill"])
@pytest.mark.slow
def test_a_restart_takes_standbys_that_run_as_workers_and_end_with_the_pool(
    tmp_path: Path, kill: str
) -> None:
    doc = _run_agent(tmp_path, _AGENT_STANDBY, "2", kill)  # exit 0: no standby left behind
    first, second = doc["first"], doc["second"]
    assert first["standby"] == 0  # the first start forks its workers
    live = doc["standbys"][1:] if kill == "kill" else doc["standbys"]
    assert second["standby"] == len(live)
    assert set(live) <= set(second["pids"])  # the dead standby's worker was forked instead
    for rnd in (first, second):
        assert {int(p): c for p, c in rnd["reaped"].items()} == {p: 0 for p in rnd["pids"]}
        assert all(w["ppid"] == doc["agent"] for w in rnd["workers"])
    # A standby's worker has a forked worker's descriptors (no pipe of the pool's kept) and
    # starts when it is asked for, not when its process was forked.
    assert {tuple(w["fds"]) for w in first["workers"] + second["workers"]} == {
        tuple(first["workers"][0]["fds"])
    }
    for w in second["workers"]:
        if w["pid"] in live:
            assert w["started"] >= second["asked"]


def test_an_agent_gone_with_a_message_unread_ends_the_pool_quietly() -> None:
    """The agent exits while the pool's last reply sits unread: the pool's next read gets a
    connection reset, which means the same as end of file (no traceback in the pod's log)."""
    import socket

    from unbroken.launcher import zygote

    pool, agent = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    zygote._send(pool, {"ready": True})  # never read by the agent
    agent.close()
    assert zygote._recv(pool) is None
    pool.close()


def test_a_pool_whose_agent_exited_before_it_was_ready_exits_quietly() -> None:
    """A spare's agent finds the job over while its warm pool still preloads: the pool's
    "ready" meets a closed socket and it exits 0, without a traceback in the pod's log."""
    import socket

    agent, pool = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.close()
    proc = subprocess.run(
        [sys.executable, "-m", "unbroken.launcher.zygote", "--fd", str(pool.fileno())],
        pass_fds=(pool.fileno(),),
        capture_output=True,
        text=True,
        timeout=60,
    )
    pool.close()
    assert (proc.returncode, proc.stderr) == (0, "")


_POOL = textwrap.dedent(
    """
    import json, os, sys
    from unbroken.launcher import bootstrap
    from unbroken.launcher.zygote import Zygote

    assert bootstrap.set_child_subreaper()
    pool = Zygote(sys.argv[2].split(","), env=dict(os.environ))
    try:
        warm = pool.wait_ready(60)
    finally:
        pool.close()
    print(json.dumps({"warm": warm, **pool.ready}))
    """
)


def test_a_thread_pool_that_stops_at_fork_keeps_the_pool_warm_and_a_plain_thread_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # numpy's OpenBLAS starts its threads at import and stops them before every fork
    # (pthread_atfork); a module's own Python thread runs on through a fork.
    (tmp_path / "spins.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # at most the cores
    blas = _run_agent(tmp_path, _POOL, "numpy")
    assert blas["threads_after_preload"] == 2, blas
    assert blas["threads"] == 1 and blas["warm"], blas
    spins = _run_agent(tmp_path, _POOL, "json,spins")
    assert spins["threads_after_preload"] == spins["threads"] == 2, spins
    assert not spins["warm"], spins
