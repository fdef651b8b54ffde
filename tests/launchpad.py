"""The test suite's launch server: ``python -m unbroken.launcher.cli`` without an interpreter
start and a torch import per launch.

Started once per pytest process (``procs.run`` starts it on first use), it imports the launcher
and the warm pool's preload modules, then serves launches over a Unix socket: each request
(arguments, environment, working directory, and the write end of the output pipe, passed as a
file descriptor) is forked into a supervisor that forks the agent (a new session, its output to
the pipe), waits for it and sends back its pid and exit status. The agent, holding every preload
module already, forks its warm pool instead of starting one (``unbroken.launcher.forked``);
everything after that (rendezvous, workers, faults, restarts) is what ``unbroken-run`` runs.
Launches through ``bin/unbroken-run``, under ``ip netns exec``, or with an environment that a
starting interpreter would read differently (``PYTHON*``, ``OMP_NUM_THREADS``) do not come here.

``python tests/launchpad.py SOCKET``: serve until the parent (pytest) dies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

_HEADER = struct.Struct("!I")


def send(sock: socket.socket, obj: object, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    msg = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.sendall(msg)


def _exact(sock: socket.socket, n: int, buf: bytes = b"") -> bytes | None:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def recv(sock: socket.socket, *, with_fds: bool = False) -> tuple[object, list[int]]:
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    else:
        head, fds = sock.recv(_HEADER.size), []
    head = _exact(sock, _HEADER.size, head)
    if head is None:
        return None, fds
    body = _exact(sock, _HEADER.unpack(head)[0])
    return (None if body is None else json.loads(body)), fds


def _supervise(conn: socket.socket, req: dict, out: int) -> None:
    """Fork the agent, ``python -m unbroken.launcher.cli ARGS`` in its own session with its
    output to ``out``; send back its pid, then its exit status."""
    from unbroken.launcher import cli, forked

    def agent() -> None:
        os.setsid()
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.chdir(req["cwd"])
        sys.path[0] = req["cwd"]  # as for ``python -m``
        sys.argv = [cli.__file__, *req["args"]]
        sys.exit(cli.main(req["args"]))

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's SIG_IGN would reap it
    child = forked.fork(agent, env=req["env"], keep_fds=(out,), close=conn)
    os.close(out)
    send(conn, {"pid": child.pid})
    send(conn, {"returncode": child.wait()})


def serve(path: str) -> None:
    import gc
    import importlib

    from unbroken.launcher import bootstrap, cli, config, rendezvous  # noqa: F401

    bootstrap.set_pdeathsig(signal.SIGKILL)  # dies with pytest
    for mod in config.DEFAULT_PRELOAD:
        importlib.import_module(mod)
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    srv.listen(64)
    os.rename(path + ".tmp", path)  # ready once it exists
    while True:
        conn, _ = srv.accept()
        req, fds = recv(conn, with_fds=True)
        if req is not None and len(fds) == 1 and os.fork() == 0:
            srv.close()
            try:
                _supervise(conn, req, fds[0])
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
