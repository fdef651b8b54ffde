"""Checkpoint writers forked from a small copy of the trainer, not from the trainer itself.

A writer forked from the trainer shares every page the trainer had, its model, optimizer state
and freed-but-kept heap included, and each of those pages the trainer writes afterwards is
copied once (copy-on-write). An in-process restart kills the failed iteration's writer and
forks a new one from a heap full of the last iteration's tensors: the first step after the
restart then pays thousands of page faults in system time, a multiple of a small model's step
on CPU (with the writer started one step later, that step pays it).

``serving()`` (entered by ``unbroken.run`` and the reference script before the first iteration
builds anything) forks a *fork server* from the trainer while its heap is small: one
single-threaded process that forks each writer on request (``ForkServer.fork_writer``). A
writer then shares pages with the server only, and the trainer's writes copy nothing. The
server reaps its writers and reports their exit codes (``returncode``); it exits when the
trainer closes it (its writers then get their parent-death signal) or dies (the server gets
its own). A writer forked this way is the trainer's grandchild: the trainer signals it by pid
and learns of its end from the server. Outside ``serving()`` writers fork from the trainer
(``client``); so do they when the server is gone.

The server is forked like a writer (``prepare_child``): every module a save needs imported
first, every inherited descriptor but its socket replaced, the trainer's signal handlers reset,
its objects frozen out of the garbage collector.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

from unbroken.checkpoint.config import CheckpointError
from unbroken.checkpoint.persisting import protocol

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PARENT_CHECK_S = 0.5
_REPLY_TIMEOUT_S = 10.0


def _replace_inherited_fds(keep: set[int]) -> None:
    """In a forked child: point every descriptor not in ``keep`` at /dev/null."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep and fd != null:
                with contextlib.suppress(OSError):  # the listing's own descriptor is gone
                    os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _reset_signal_handlers() -> None:
    """In a forked child: every signal handled in Python back to its default (the writer
    installs its own), so none of the trainer's handlers runs in the child."""
    for sig in signal.valid_signals() - {signal.SIGINT}:  # the writer ignores SIGINT itself
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (``_serve``)


def prepare_child(keep: set[int]) -> None:
    """In a child forked to become a writer or the fork server: never collect what the parent
    left (its pending garbage, e.g. a failed iteration's process group, has C++ destructors
    that join threads the child does not have: a forked writer once hung in such a
    collection), keep only ``keep`` and stdio open, and drop the parent's signal handling."""
    gc.freeze()
    _replace_inherited_fds({0, 1, 2, *keep})
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    _reset_signal_handlers()


def run_writer(argv: list[str], *, sock_fd: int) -> NoReturn:
    """A child just forked to be a writer on ``sock_fd``: ``prepare_child``, the writer's main,
    then ``os._exit`` (nothing of the parent's runs in it, not even on an error)."""
    from unbroken.checkpoint.persisting import writer

    code = 70
    try:
        prepare_child({sock_fd})
        code = writer.main(argv)
    except BaseException:  # noqa: BLE001 - report anything, then leave without cleanup
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(code)


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def _serve(sock: socket.socket, parent: int, *, pdeathsig: bool) -> None:
    """The server's loop: fork a writer per request, report each one's exit, leave when the
    trainer closes the socket or dies."""
    if pdeathsig:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # A SIGTERM to the trainer's process group (the launcher stopping it, a pod's stop) is the
    # trainer's to act on: a graceful preemption saves through writers this server forks. The
    # server leaves with the trainer (its socket, the parent check, PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
    while os.getppid() == parent:
        ready = select.select([sock.fileno(), wake_r], [], [], _PARENT_CHECK_S)[0]
        if wake_r in ready:
            os.read(wake_r, 512)
        while True:  # reap every writer that ended; the trainer learns its code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            protocol.send(sock, {"type": "exit", "pid": pid, "code": _exit_code(status)})
        if sock.fileno() not in ready:
            continue
        try:
            msg, fds = protocol.recv(sock)
        except (protocol.PeerGone, OSError):
            return
        if msg.get("type") != "fork" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            protocol.send(sock, {"type": "refused", "why": f"not a fork request: {msg!r}"[:200]})
            continue
        pid = os.fork()
        if pid == 0:  # the descriptor's number here (the last --fd wins)
            run_writer([*msg["argv"], "--fd", str(fds[0])], sock_fd=fds[0])
        os.close(fds[0])
        protocol.send(sock, {"type": "forked", "pid": pid})


class ForkServer:
    """The trainer's handle on its fork server. Methods may be called from any thread."""

    def __init__(self) -> None:
        from unbroken.checkpoint.persisting import writer

        writer.preload()  # the server and its writers import nothing (see writer.preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent = os.getpid()
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits: only from the
        # main thread, which lives as long as the process (else the server polls its parent).
        pdeathsig = threading.current_thread() is threading.main_thread()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                ours.close()
                prepare_child({theirs.fileno()})
                _serve(theirs, parent, pdeathsig=pdeathsig)
                code = 0
            except BaseException:  # noqa: BLE001 - report anything, then leave
                with contextlib.suppress(Exception):
                    traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self.owner = parent
        """The process this server forks writers for (a forked child must not use it)."""
        self._sock = ours
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}
        self._gone = False

    def _pump(self, timeout_s: float, *, until: str | None = None) -> dict[str, Any] | None:
        """Read the server's messages (exit codes kept) for up to ``timeout_s``, or until one
        of type ``until`` came (returned). Caller holds the lock."""
        deadline = time.monotonic() + timeout_s
        while not self._gone:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._sock], [], [], max(0.0, left))
            if not ready:
                return None
            try:
                msg, fds = protocol.recv(self._sock)
            except (protocol.PeerGone, OSError):
                self._gone = True
                break
            for fd in fds:
                os.close(fd)
            if msg.get("type") == "exit":
                self._codes[int(msg["pid"])] = int(msg["code"])
            elif until is not None and msg.get("type") in (until, "refused"):
                return msg
        return None

    def fork_writer(self, argv: list[str], sock_fd: int) -> int:
        """A writer running ``writer.main(argv)`` on ``sock_fd`` (which this process keeps);
        its pid. Raises CheckpointError when the server is gone or refuses."""
        with self._lock:
            if self._gone:
                raise CheckpointError(f"the writer fork server {self.pid} is gone")
            try:
                protocol.send(self._sock, {"type": "fork", "argv": argv}, fds=(sock_fd,))
            except OSError as e:
                self._gone = True
                raise CheckpointError(f"the writer fork server {self.pid} is gone: {e}") from e
            reply = self._pump(_REPLY_TIMEOUT_S, until="forked")
        if reply is None or reply.get("type") != "forked":
            why = "no reply" if reply is None else reply.get("why")
            raise CheckpointError(f"the writer fork server {self.pid} forked no writer: {why}")
        return int(reply["pid"])

    def returncode(self, pid: int) -> int | None:
        """The exit code of writer ``pid`` (negative: the signal), None while it runs; -1 when
        the server is gone without saying (its writers died with it)."""
        with self._lock:
            if pid not in self._codes:
                self._pump(0.0)
            if pid not in self._codes and self._gone:
                return -1
            return self._codes.get(pid)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the server (writers still running get their parent-death signal) and reap it."""
        with self._lock:
            self._gone = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        logger.warning("writer fork server %d did not exit; killing it", self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class PolledProcess:
    """The ``subprocess.Popen`` calls the client uses (``poll``, ``wait``, ``kill``), for a
    writer that is not a ``Popen``: ``poll`` says how it learns the exit code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"writer {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class ServedProcess(PolledProcess):
    """A writer the server forked: its exit code comes from the server."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        super().__init__(pid)
        self.server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid)
        return self.returncode


_current: ForkServer | None = None


def current() -> ForkServer | None:
    """The fork server writers of this process fork from (None: fork from the trainer)."""
    server = _current
    return server if server is not None and server.owner == os.getpid() else None


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """Fork writers of the enclosed block from a fork server made now (nests: an enclosing
    one is kept). Where it cannot be made, writers fork from the trainer (logged)."""
    global _current
    if current() is not None or not hasattr(os, "fork"):
        yield
        return
    try:
        server = ForkServer()
    except (OSError, ImportError) as e:
        logger.warning("no writer fork server (%s); writers fork from the trainer", e)
        yield
        return
    _current = server
    try:
        yield
    finally:
        _current = None
        server.close()
