"""The warm pool: a process that has imported torch once and forks workers on request.

The agent starts it at launch (``python -m unbroken.launcher.zygote --fd N``), in parallel with
its own start-up. It imports the preload modules (by default torch, torch.distributed and the
lazily imported torch._dynamo that the first DDP()/fully_shard() pays), freezes the heap
(``gc.freeze``: no copy-on-write churn in the children), checks that no thread runs, and
serves spawn requests over a socketpair (length-prefixed JSON). A pool that runs a thread or has
initialized CUDA (a forked child could not use it) is not used: workers then start cold. A thread
pool that stops itself before every fork (OpenBLAS's, which numpy starts unless
``OMP_NUM_THREADS`` is set) is no such thread: the check counts what runs after one throwaway
fork.

Each worker is double-forked: the zygote forks an intermediate that forks the worker and exits
at once, so the worker is re-parented to the agent, which is a child subreaper. The agent can
then reap it, see its exit status and signal its process group like any child; the zygote
stays single-threaded and holds no state about workers. The zygote dies with the agent
(PR_SET_PDEATHSIG), and so does every worker (see ``bootstrap``).

Standbys: once a node's workers run and the pool has been idle for ``STANDBY_DELAY_S``, it
forks as many *standby* workers as the last request had: double-forked like the others (so the
agent's children), they wait on a socket for their request. A restart hands each worker's request
to a standby, which runs at once: the forks and the intermediates' exits (growing with the workers
per node) leave the restart's path. A standby whose socket is closed (it died) is skipped
and its worker forked as without standbys; standbys exit when the pool does (EOF on their socket) or with
the agent (PR_SET_PDEATHSIG), and the agent reaps them as the orphans they are.

``Zygote`` is the agent's handle on it. An agent that already holds every preload module (it
was itself forked from a process that imported them, as the test suite's launch server does)
forks the pool instead of starting an interpreter that would import them again (``forked``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from unbroken.launcher import bootstrap, forked
from unbroken.launcher.errors import LauncherError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")

STANDBY_DELAY_S = 1.0
"""Idle seconds after a start before the pool forks standbys (not while the workers start)."""


def _send(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionResetError:  # the agent exited with our last message unread: gone
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


_threads = forked.threads


def _threads_past_a_fork() -> int:
    """The threads that still run after a fork: a thread pool that a ``pthread_atfork`` prepare
    handler shuts down before every fork (OpenBLAS's, which numpy starts at import unless
    ``OMP_NUM_THREADS`` or ``OPENBLAS_NUM_THREADS`` is set) leaves no lock held in a forked
    child and does not count. One throwaway child, which exits at once, runs the handlers."""
    threads = _threads()
    if threads == 1:
        return 1
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _threads()


# --- the zygote process ----------------------------------------------------------------------
class _Forked(NamedTuple):
    mid: int
    """The intermediate's pid (the zygote reaps it)."""
    pid_r: int
    """The pipe the worker's pid comes on."""
    standby_w: int | None
    """A standby's request socket (the zygote's end); None for a worker with its request."""


def _fork_worker(
    req: dict[str, Any] | None, sock: socket.socket, inherited: Sequence[int]
) -> _Forked | dict[str, Any]:
    """In the zygote: what it keeps of the fork. In the worker: its request (return to
    __main__); a standby (``req`` None) gets the socket its request comes on (``standby_fd``)
    instead. ``inherited``: the zygote's pipes of the workers forked before this one and of
    the standbys, which no child keeps (a standby's socket held by another process would not
    read EOF when the zygote exits)."""
    standby_w = None
    if req is None:  # a socket pair, so the request goes with ``_send`` / ``_recv``
        standby_r, standby_w = (end.detach() for end in socket.socketpair())
        req = {"standby_fd": standby_r}
        inherited = [*inherited, standby_w]
    r, w = os.pipe()
    # The gate: its write end lives only in the intermediate, so the worker reads its EOF when
    # the intermediate exits (then it is about to be re-parented: bootstrap.await_parent).
    gate_r, gate_w = os.pipe()
    try:
        mid = os.fork()
    except OSError:
        mine = [r, w, gate_r, gate_w]
        if standby_w is not None:
            mine += [req["standby_fd"], standby_w]
        for fd in mine:
            os.close(fd)
        raise
    if mid == 0:  # the intermediate: fork the worker, report its pid, vanish
        os.close(r)
        for fd in inherited:
            os.close(fd)
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(w)
            os.close(gate_w)
            sock.close()
            return {**req, "gate_fd": gate_r}
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    os.close(gate_r)
    os.close(gate_w)
    if standby_w is not None:
        os.close(req["standby_fd"])
    return _Forked(mid, r, standby_w)


def _read_pid(r: int) -> int:
    data = os.read(r, 32)
    os.close(r)
    return int(data) if data else -1


def _hand_over(standby_w: int, req: dict[str, Any]) -> bool:
    """Give a standby its request; False when it is gone (its end of the socket is closed)."""
    with socket.socket(fileno=standby_w) as end:
        try:
            _send(end, req)
        except OSError:  # BrokenPipeError, ConnectionResetError
            return False
    return True


def await_request(fd: int) -> dict[str, Any] | None:
    """In a standby: block until the zygote hands over a request; None when it has exited."""
    with socket.socket(fileno=fd) as end:
        return _recv(end)


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answer spawn requests until the agent hangs up (None); in a worker, its request.

    The workers of a request start in parallel: every intermediate is forked before any pid is
    read, and the intermediates are reaped after the reply. A worker runs once its intermediate
    has exited (``bootstrap`` waits to be the agent's child), so waiting for one intermediate
    before forking the next would add a whole exit (the teardown of a process the zygote's size)
    per worker. Standbys (see above) are
    forked while the pool is idle and used first."""
    standbys: list[tuple[int, int]] = []  # (pid, request socket)
    want = 0
    answered = 0.0
    while True:
        timeout = None
        if len(standbys) < want:
            timeout = max(0.0, answered + STANDBY_DELAY_S - time.monotonic())
        if not select.select([sock], [], [], timeout)[0]:
            if _threads() > 1:
                want = 0  # never fork from a threaded pool; requests get the error below
                continue
            try:
                out = _fork_worker(None, sock, [w for _, w in standbys])
            except OSError:  # out of processes or memory: no standbys until the next request
                want = 0
                continue
            if isinstance(out, dict):
                return out
            pid = _read_pid(out.pid_r)
            os.waitpid(out.mid, 0)
            assert out.standby_w is not None
            if pid > 0:
                standbys.append((pid, out.standby_w))
            else:
                os.close(out.standby_w)
                want = 0  # the pool cannot fork: stop trying until the next request
            continue
        msg = _recv(sock)
        if msg is None:
            for _, w in standbys:
                os.close(w)
            return None
        if _threads() > 1:
            _send(sock, {"error": f"the warm pool has {_threads()} threads; refusing to fork"})
            continue
        reqs = msg["workers"]
        want = len(reqs)
        pids: list[int] = []
        while standbys and len(pids) < len(reqs):
            pid, w = standbys.pop(0)
            if _hand_over(w, reqs[len(pids)]):
                pids.append(pid)
        from_standby = len(pids)
        forked: list[_Forked] = []
        for req in reqs[from_standby:]:
            sys.stdout.flush()
            sys.stderr.flush()
            out = _fork_worker(req, sock, [f.pid_r for f in forked] + [w for _, w in standbys])
            if isinstance(out, dict):
                return out
            forked.append(out)
        pids += [_read_pid(f.pid_r) for f in forked]
        _send(sock, {"pids": pids, "standby": from_standby})
        for f in forked:
            os.waitpid(f.mid, 0)
        answered = time.monotonic()


def main(argv: Sequence[str]) -> tuple[dict[str, Any], int] | None:
    p = argparse.ArgumentParser(prog="python -m unbroken.launcher.zygote")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--preload", default="")
    ns = p.parse_args(argv)
    agent_pid = os.getppid()
    bootstrap.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != agent_pid:
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's to handle
    sock = socket.socket(fileno=ns.fd)
    t0 = time.monotonic()
    failed = {}
    for mod in filter(None, ns.preload.split(",")):
        try:
            importlib.import_module(mod)
        except Exception as e:  # a bad preload costs speed, not correctness
            failed[mod] = f"{type(e).__name__}: {e}"
    gc.collect()
    gc.freeze()
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    _send(
        sock,
        {
            "ready": True,
            "preload_s": time.monotonic() - t0,
            "failed": failed,
            "threads_after_preload": _threads(),
            "threads": _threads_past_a_fork(),
            "cuda_initialized": cuda,
            "pid": os.getpid(),
        },
    )
    req = serve(sock)
    return None if req is None else (req, agent_pid)


# --- the agent's handle ----------------------------------------------------------------------
class Zygote:
    """Start the warm pool; ``spawn`` forks workers from it. Not thread-safe."""

    def __init__(self, preload: Sequence[str], *, env: dict[str, str]) -> None:
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = ["--fd", str(child.fileno()), "--preload", ",".join(preload)]
        self.proc: subprocess.Popen[bytes] | forked.Forked
        if forked.can_fork(preload):
            self.proc = forked.fork(
                lambda: run(argv), env=env, keep_fds=(child.fileno(),), close=self._sock
            )
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "unbroken.launcher.zygote", *argv],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        child.close()
        self.preload = tuple(preload)
        self.pid = self.proc.pid
        self.ready: dict[str, Any] | None = None
        self.dead = False
        self.standby = 0
        """How many workers of the last ``spawn`` were standbys (see above)."""

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the pool has imported its modules, if it is safe to fork from."""
        if self.dead:
            return False
        if self.ready is None:
            self._sock.settimeout(timeout_s)
            try:
                msg = _recv(self._sock)
            except OSError:
                msg = None
            if not msg:
                logger.warning("the warm pool did not come up; starting workers cold")
                self.dead = True
                return False
            self.ready = msg
            if msg.get("failed"):
                logger.warning("warm pool: could not preload %s", msg["failed"])
            if msg.get("cuda_initialized"):
                logger.warning(
                    "warm pool: a preload module initialized CUDA, which a forked "
                    "worker cannot use; starting workers cold"
                )
                self.dead = True
            elif int(msg.get("threads", 1)) != 1:
                logger.warning(
                    "warm pool: %s threads run after the preload (%s), and a fork does not "
                    "stop them: forking is unsafe, starting workers cold. A preload module "
                    "started them: take it out of --ft-preload",
                    msg.get("threads"),
                    ",".join(self.preload) or "nothing preloaded",
                )
                self.dead = True
            else:
                logger.info("warm pool ready: preloaded in %.2f s", msg.get("preload_s", 0.0))
        return not self.dead

    def spawn(self, requests: list[dict[str, Any]], *, timeout_s: float) -> list[int]:
        """Fork one worker per request; their pids. Raises LauncherError on any problem."""
        if not self.wait_ready(timeout_s):
            raise LauncherError("the warm pool is not usable (see the warnings above)")
        self._sock.settimeout(timeout_s)
        try:
            _send(self._sock, {"workers": requests})
            reply = _recv(self._sock)
        except OSError as e:
            self.dead = True
            raise LauncherError(f"the warm pool stopped answering: {e}") from e
        if not reply or "pids" not in reply or min(reply["pids"], default=0) <= 0:
            self.dead = True
            for pid in (reply or {}).get("pids", []):  # the half that did start: not ours now
                if pid > 0:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            raise LauncherError(f"the warm pool could not fork workers: {reply}")
        self.standby = int(reply.get("standby", 0))
        return [int(p) for p in reply["pids"]]

    def close(self, timeout_s: float = 5.0) -> None:
        self.dead = True
        self._sock.close()
        if self.proc.returncode is None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run(argv: Sequence[str]) -> None:
    """What ``python -m unbroken.launcher.zygote`` does: serve as the pool until it closes;
    in a forked worker, become the worker and run its target (returns when it returns)."""
    try:
        started = main(argv)
    except (BrokenPipeError, ConnectionResetError):  # the agent exited before it read us
        started = None
    if started is None:
        return
    req, agent_pid = started
    del started
    if "standby_fd" in req:  # wait as the agent's child until a restart needs this worker
        bootstrap.await_parent(agent_pid, gate_fd=req.pop("gate_fd"))
        handed = await_request(req["standby_fd"])
        if handed is None:
            os._exit(0)
        req = {**handed, "activated": time.time()}
        del handed
    bootstrap.become_worker(req, agent_pid=agent_pid)
    bootstrap.run_target(req)


if __name__ == "__main__":
    run(sys.argv[1:])
