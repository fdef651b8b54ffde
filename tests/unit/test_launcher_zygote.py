"""The warm pool forks a request's workers in parallel: every worker runs as the agent's child,
and none holds the pool's pipes of the workers forked before it. Run in a child interpreter
that is a subreaper, as the agent is (making pytest one would adopt other tests' orphans)."""

from __future__ import annotations

import json
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
    pool = Zygote(["json"], env=dict(os.environ))
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
        "pids": pids,
        "reaped": reaped,
        "workers": [json.loads(o.read_text()) for o in outs],
    }))
    """
)


@pytest.mark.parametrize("n", [1, 4])
def test_a_requests_workers_are_the_agents_children_and_share_no_pipe(
    tmp_path: Path, n: int
) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(_AGENT)
    proc = subprocess.run(
        [sys.executable, str(agent), str(tmp_path), str(n)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    workers = doc["workers"]
    assert sorted(w["pid"] for w in workers) == sorted(doc["pids"])
    assert len(set(doc["pids"])) == n
    assert all(w["ppid"] == doc["agent"] for w in workers)  # re-parented to the subreaper
    assert {int(p): c for p, c in doc["reaped"].items()} == {p: 0 for p in doc["pids"]}
    # Every worker has the same descriptors: the pipes of the workers forked before it (the
    # pool holds them until it has read every pid) stay behind.
    assert len({tuple(w["fds"]) for w in workers}) == 1, workers
