"""Rendezvous rounds at scale: n launcher agents (processes) on loopback forming a round with
the real ``launcher.rendezvous.C10dRendezvous`` (torch's c10d rendezvous on a TCPStore), then
re-forming it after one agent is SIGKILLed, a hot spare taking its place.

Stood in: everything of an agent but its rendezvous (no workers, no heartbeats). The job store
lives in this process (as the store pod does on Kubernetes: no agent's loss takes it along).
The job is ``--nnodes n`` (min = max = n) plus one spare, which waits on the rendezvous'
redundancy list; keep-alive 0.5 s x 6, state polled every 50 ms. Measured:

- form: "go" -> the last of the n agents has its ``RoundInfo``;
- notice: the SIGKILL -> the last survivor sees the node gone (``membership()``, the agent's
  own check, polled every 50 ms): the keep-alive expiry dominates;
- re-form: the SIGKILL -> every survivor and the spare have the next round's ``RoundInfo``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

# A node is lost after 3 s of silence: shorter (0.25 s x 4) drops healthy agents of a loaded
# machine from the round while it forms (torch's default is 5 s x 3).
KEEP_ALIVE_S = 0.5
KEEP_ALIVE_ATTEMPTS = 6
POLL_S = 0.05


def agent(port: int, n: int) -> None:
    """One stand-in agent: join on "go", report rounds and a lost node as JSON lines."""
    from unbroken.launcher import args as largs
    from unbroken.launcher.rendezvous import C10dRendezvous

    spec = largs.JobSpec(
        min_nodes=n,
        max_nodes=n,
        nproc_per_node=1,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_id="scale",
        rdzv_conf={
            "keep_alive_interval": str(KEEP_ALIVE_S),
            "keep_alive_max_attempt": str(KEEP_ALIVE_ATTEMPTS),
        },
        is_host=False,
        entry=largs.Entrypoint(kind="script", target="stand-in"),
    )
    rdzv = C10dRendezvous(spec, node_addr="127.0.0.1", timeout_s=120.0, poll_s=POLL_S)

    def say(**msg: Any) -> None:
        print(json.dumps({"pid": os.getpid(), "t": time.time(), **msg}), flush=True)

    say(event="ready")
    if sys.stdin.readline().strip() != "go":
        return
    rounds = 0
    while rounds < 2:
        info = rdzv.next_round()  # a spare waits here until a node is lost
        rounds += 1
        say(event="round", round=info.round, group_rank=info.group_rank)
        while rounds < 2:  # the agent's membership check while its workers run
            if rdzv.membership()[1]:
                say(event="lost")
                break  # it stops its workers and rejoins at once
            time.sleep(POLL_S)
    sys.stdin.readline()
    rdzv.close()


class _Agents:
    def __init__(self, port: int, count: int, n: int) -> None:
        code = f"from unbroken.bench.scale_rendezvous import agent; agent({port}, {n})"
        # the agents' stderr, shown on a failure; closed by close()
        self.errs = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errs,
                text=True,
                bufsize=1,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            for _ in range(count)
        ]
        self.sel = selectors.DefaultSelector()
        for i, p in enumerate(self.procs):
            assert p.stdout is not None
            os.set_blocking(p.stdout.fileno(), True)
            self.sel.register(p.stdout, selectors.EVENT_READ, i)

    def send(self, i: int, line: str) -> None:
        stdin = self.procs[i].stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def collect(self, want: dict[int, str], *, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Wait until agent i printed an event ``want[i]``; {i: that message}."""
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(want):
            left = deadline - time.monotonic()
            dead = [i for i in want if i not in got and self.procs[i].poll() is not None]
            if left <= 0 or dead:
                missing = sorted(set(want) - set(got))
                self.errs.seek(0)
                tail = self.errs.read()[-3000:]
                raise RuntimeError(
                    f"agents {missing} did not report {want[missing[0]]!r}"
                    + (f" ({dead} exited)" if dead else "")
                    + f"; their stderr ends:\n{tail}"
                )
            for key, _ in self.sel.select(timeout=left):
                i = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    self.sel.unregister(key.fileobj)
                    continue
                if line.startswith("{"):
                    msg = json.loads(line)
                    if i in want and msg["event"] == want[i] and i not in got:
                        got[i] = msg
        return got

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
        self.sel.close()
        self.errs.close()


def measure(n: int, *, timeout_s: float = 300.0) -> dict[str, Any]:
    """n agents and one spare: form a round, lose agent n - 1, re-form."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agents = _Agents(store.port, n + 1, n)
    spare = n
    try:
        agents.collect({i: "ready" for i in range(n + 1)}, timeout_s=timeout_s)
        go = time.time()
        for i in range(n):
            agents.send(i, "go")
        first = agents.collect({i: "round" for i in range(n)}, timeout_s=timeout_s)
        formed = max(m["t"] for m in first.values()) - go
        agents.send(spare, "go")  # now it can only wait on the redundancy list
        time.sleep(1.0)
        victim = n - 1
        killed = time.time()
        agents.procs[victim].send_signal(signal.SIGKILL)
        survivors = [i for i in range(n) if i != victim]
        lost = agents.collect({i: "lost" for i in survivors}, timeout_s=timeout_s)
        second = agents.collect({i: "round" for i in [*survivors, spare]}, timeout_s=timeout_s)
        rounds = {m["round"] for m in second.values()}
        for i in [*survivors, spare]:
            agents.send(i, "exit")
    finally:
        agents.close()
    return {
        "agents": n,
        "form_s": formed,
        "notice_s": max(m["t"] for m in lost.values()) - killed,
        "reform_s": max(m["t"] for m in second.values()) - killed,
        "keep_alive_expiry_s": KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS,
        "rounds": sorted({m["round"] for m in first.values()} | rounds),
        "spare_joined": second[spare]["group_rank"] is not None,
    }
