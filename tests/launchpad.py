"""The test suite's launch server: ``python -m MODULE`` without an interpreter start and a torch
import per launch.

Started once per pytest process (``procs.run`` starts it on first use), it imports the launcher
and the warm pool's preload modules, then serves launches over a Unix socket: each request
(the module, its arguments, environment and working directory, and the descriptors of its
output passed along) is forked into a supervisor that forks the module's ``main`` (a new
session), sends back its pid, relays the signals the requester sends, and sends its exit
status. MODULE is one of ``SERVED`` (``unbroken.launcher.cli`` by default) or a script's path
(``python SCRIPT.py``: a rank of a job without a launcher, as the benches' baselines run). An
agent, holding every preload module already, forks its warm pool instead of starting one
(``unbroken.launcher.forked``); everything after that (rendezvous, workers, faults, restarts)
is what ``unbroken-run`` runs. torchrun's agent, served, starts its workers as
``padclient.py`` commands that the server forks (``route_torchrun_workers``).

A request with ``join`` runs the module in the requester's namespaces (network, hostname,
PID, mounts): ``padclient.py``, the command of an emulated pod's container, asks for that, so
the module runs inside the pod as its own process would, and dies with the pod.

Launches through ``bin/unbroken-run``, or with an environment that a starting interpreter would
read differently (``PYTHON*``, ``OMP_NUM_THREADS``) do not come here.

``python tests/launchpad.py SOCKET``: serve until the parent (pytest) dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

_HEADER = struct.Struct("!I")
SERVED = (
    "unbroken.launcher.cli",
    "unbroken.cli",
    "unbroken.observe",
    "unbroken.workload.train",
    "torch.distributed.run",
    "unbroken.restart.store_server",
)
"""The modules this server runs (and scripts: ``python SCRIPT.py``)."""
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "padclient.py")


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


_CLONE = {"net": 0x40000000, "uts": 0x04000000, "pid": 0x20000000, "mnt": 0x00020000}
"""The namespaces a ``join`` enters, the mounts last (``/proc`` paths change with them)."""


def _join(pid: int) -> None:
    """Enter the namespaces of process ``pid`` that differ from this one's (Python 3.11 has no
    ``os.setns``); the PID namespace holds this process's children to come."""
    libc = ctypes.CDLL(None, use_errno=True)
    fds = {}
    for ns in _CLONE:
        theirs = f"/proc/{pid}/ns/{ns}"
        if os.stat(theirs).st_ino != os.stat(f"/proc/self/ns/{ns}").st_ino:
            fds[ns] = os.open(theirs, os.O_RDONLY)
    for ns, fd in fds.items():
        if libc.setns(fd, _CLONE[ns]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}) into pid {pid}: {os.strerror(err)}")
        os.close(fd)


def _main(module: str) -> tuple[Callable[[list[str]], object], str]:
    """The module's ``main(argv)`` and its file (a script: one that runs it as ``__main__``)."""
    if module == "-c":

        def code(args: list[str]) -> int:
            sys.argv = ["-c", *args[1:]]
            exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
            return 0

        return code, "-c"
    if module.endswith(".py"):

        def script(_args: list[str]) -> int:
            runpy.run_path(module, run_name="__main__")
            return 0

        return script, module
    if module == "unbroken.launcher.cli":
        from unbroken.launcher import cli

        return cli.main, cli.__file__
    mod = importlib.import_module(module)
    return mod.main, mod.__file__


def _supervise(conn: socket.socket, req: dict, fds: list[int], server: str) -> None:
    """Fork ``python -m MODULE ARGS`` in its own session with ``fds`` as its standard
    descriptors ``req["std"]`` (by default its stdout, and its stderr if given); send back its
    pid, relay the signals asked for, send its exit status. If the requester goes away first,
    the module's session is killed."""
    from unbroken.launcher import forked

    target = req.get("module", "unbroken.launcher.cli")
    main, file = _main(target)
    if req.get("join"):
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        _join(peer[0])

    given = dict(zip(req.get("std") or (1, 2)[: len(fds)], fds, strict=True))
    if 1 in given:
        given.setdefault(2, given[1])

    def run() -> None:
        os.setsid()
        for n, fd in given.items():
            os.dup2(fd, n)
        for fd in set(fds):
            os.close(fd)
        os.chdir(req["cwd"])
        if target.endswith(".py"):  # sys.path[0] as python sets it
            sys.path[0] = os.path.dirname(file)
        else:
            sys.path[0] = "" if target == "-c" else req["cwd"]
        if os.environ.get("PYTHONUNBUFFERED"):  # as ``python -u``
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True, line_buffering=True)
        omp = os.environ.get("OMP_NUM_THREADS")
        route_pods(lambda: server, omp)
        route_store_server(lambda: server, omp)
        if target == "torch.distributed.run":
            route_torchrun_workers(lambda: server, omp)
        sys.argv = [file, *req["args"]]
        sys.exit(main(req["args"]))

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's SIG_IGN would reap it
    child = forked.fork(run, env=req["env"], keep_fds=fds, close=conn)
    for fd in set(fds):
        os.close(fd)
    send(conn, {"pid": child.pid})
    ended = os.pidfd_open(child.pid)  # readable once it exits: no polling
    while ended not in select.select([conn, ended], [], [])[0]:
        msg, _ = recv(conn)
        if msg is None:  # the requester is gone (an emulated pod killed): so is the module
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, msg["signal"])
    os.close(ended)
    send(conn, {"returncode": child.wait()})


def served_argv(argv: list[str], *, code: bool = False) -> list[str] | None:
    """``[MODULE or SCRIPT, ARGS...]`` when ``argv`` is this Python running what is served (a
    script named by its absolute path; with ``code``, ``-c CODE``: ``["-c", CODE, ARGS...]``,
    for a caller that knows the code does not look at its parent: it is the server's
    supervisor)."""
    if argv[:1] != [sys.executable] or len(argv) < 2:
        return None
    if argv[1] == "-m" and len(argv) > 2 and argv[2] in SERVED:
        return argv[2:]
    if code and argv[1] == "-c" and len(argv) > 2:
        return argv[1:]
    if argv[1].endswith(".py") and os.path.isabs(argv[1]) and os.path.isfile(argv[1]):
        return argv[1:]
    return None


def client_argv(
    argv: list[str],
    env: Mapping[str, str],
    path: Callable[[], str | None],
    omp: str | None,
) -> list[str] | None:
    """``argv`` as a ``padclient.py`` command of the server at ``path()`` (asked only then: it
    may start the server), when it serves ``argv`` and an interpreter started with ``env``
    would have torch's thread count ``omp`` (the server's); else None (run ``argv`` as is)."""
    served = served_argv(argv)
    if served is None or env.get("OMP_NUM_THREADS") != omp or (server := path()) is None:
        return None
    return [sys.executable, "-S", "-E", CLIENT, server, *served]


def route_pods(path: Callable[[], str | None], omp: str | None) -> None:
    """Start the emulated pods' ``python -m MODULE`` containers (MODULE served here, torch's
    thread count ``omp``) as ``padclient.py`` commands: the module forked from the server at
    ``path()`` (None: the server is off) into the pod. Installed once per process."""
    from unbroken.k8s.emulate import pod

    start = pod.Pod.start
    if getattr(start, "routed", False):
        return

    def routed(self: pod.Pod, argv: list[str], **kw: Any) -> None:
        start(self, client_argv(argv, kw["env"], path, omp) or argv, **kw)

    routed.routed = True  # type: ignore[attr-defined]
    pod.Pod.start = routed  # type: ignore[method-assign]


def route_torchrun_workers(path: Callable[[], str | None], omp: str | None) -> None:
    """Start torchrun's workers (``python -u SCRIPT`` or ``-m MODULE``, served here, torch's
    thread count ``omp``) as ``padclient.py`` commands: forked from the server at ``path()``,
    not interpreters of their own. torchrun's agent sees the client as its worker: its
    SIGTERM is passed on, its SIGKILL ends the worker's session, and the worker's exit status
    (its signal) is the client's. Installed once per process."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    popen = handler._popen
    if getattr(popen, "routed", False):
        return

    def routed(self: Any, args: tuple, env: dict[str, str]) -> Any:
        argv = list(args)
        unbuffered = argv[1:2] == ["-u"]
        client = client_argv(argv[:1] + argv[2:] if unbuffered else argv, env, path, omp)
        if client is None:
            return popen(self, args, env)
        return popen(self, tuple(client), {**env, "PYTHONUNBUFFERED": "1"} if unbuffered else env)

    routed.routed = True  # type: ignore[attr-defined]
    handler._popen = routed  # type: ignore[method-assign]


def route_store_server(path: Callable[[], str | None], omp: str | None) -> None:
    """Start the store server a rank without a launcher starts (``unbroken.restart.store``:
    ``python -m unbroken.restart.store_server``, its stdin and stdout pipes of the rank's) as
    a ``padclient.py`` command: forked from the server at ``path()``. Installed once per
    process."""
    import subprocess
    import types

    from unbroken.restart import store

    if getattr(store.subprocess.Popen, "routed", False):
        return
    popen = subprocess.Popen

    def routed(argv: list[str], **kw: Any) -> subprocess.Popen:
        return popen(client_argv(list(argv), kw.get("env") or os.environ, path, omp) or argv, **kw)

    routed.routed = True  # type: ignore[attr-defined]
    store.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": routed})


def serve(path: str) -> None:
    import gc
    import importlib

    from unbroken.k8s.emulate import pod  # noqa: F401
    from unbroken.launcher import cli, config, rendezvous  # noqa: F401

    # Ends with pytest: its process, watched (a parent-death signal would come when the thread
    # that started this server ends, and pytest may start it from any thread).
    parent = os.pidfd_open(os.getppid())
    for mod in (*config.DEFAULT_PRELOAD, "unbroken.workload.train"):  # the benches' preload
        importlib.import_module(mod)
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    srv.listen(64)
    os.rename(path + ".tmp", path)  # ready once it exists
    while parent not in select.select([srv, parent], [], [])[0]:
        conn, _ = srv.accept()
        req, fds = recv(conn, with_fds=True)
        if req is not None and 1 <= len(fds) <= 3 and os.fork() == 0:
            srv.close()
            os.close(parent)
            try:
                _supervise(conn, req, fds, path)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
