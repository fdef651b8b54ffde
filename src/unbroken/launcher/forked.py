"""A child process forked from this one that then lives as if its own interpreter had started.

The agent starts its warm pool as a fresh interpreter, which imports torch (seconds of CPU).
An agent that already holds every module the pool would import (because it was itself forked
from a process that imported them, as the test suite's launch server does) forks the pool
instead. ``fork`` gives the child what a fresh interpreter would have (default signal
handlers, stdin from /dev/null, the given environment, an unconfigured root logger) and ends
it as an interpreter ends (non-daemon threads joined, ``atexit`` functions run, stdio flushed),
without ever returning into the parent's call stack. ``Forked`` is the parent's handle, with
the parts of ``subprocess.Popen`` the agent uses.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def threads() -> int:
    """The threads this process runs, native ones included (``/proc``)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def can_fork(modules: Sequence[str]) -> bool:
    """Whether forking saves the child its imports and is safe: every module in ``modules``
    (non-empty) is imported and this process runs one thread."""
    return bool(modules) and all(m in sys.modules for m in modules) and threads() == 1


def exit_code(e: SystemExit) -> int:
    """The exit status an interpreter gives ``sys.exit(e.code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def end(code: int) -> NoReturn:
    """End this process as the interpreter would at exit, never unwinding the stack."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def call_and_end(fn: Callable[[], object]) -> NoReturn:
    """Run ``fn`` as a script's body: its SystemExit is the exit code, an exception prints
    its traceback and exits 1."""
    try:
        fn()
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    end(code)


class Forked:
    """The parent's handle on a forked child: ``pid``, ``returncode``, ``wait``, ``kill``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (the agent reaps orphans)
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None and self.returncode is None:
            try:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:  # reaped by someone else
                self.returncode = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _close_fds(keep: Sequence[int]) -> None:
    """Close every descriptor but stdio and ``keep``, as ``subprocess.Popen(close_fds=True)``:
    none of the parent's (a run directory's lock, its sockets) lives on in the child."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def fork(
    fn: Callable[[], object],
    *,
    env: dict[str, str],
    keep_fds: Sequence[int] = (),
    close: socket.socket | None = None,
) -> Forked:
    """Fork a child that runs ``fn`` as a fresh interpreter would run a script (see above).

    Args:
        fn: The child's work; its return ends the child with exit code 0.
        env: The child's whole environment.
        keep_fds: Descriptors the child keeps besides stdio (``pass_fds``); it closes the rest.
        close: A socket object of the parent's that the child must not use (closed with its
            descriptor).

    Returns:
        The parent's handle on the child.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return Forked(pid)
    try:
        if close is not None:
            close.close()
        _close_fds(keep_fds)
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.setLevel(logging.WARNING)
    except BaseException:
        traceback.print_exc()
        end(1)
    call_and_end(fn)
