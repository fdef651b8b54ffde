"""Turn a freshly forked copy of the warm pool into a worker, then run the user's code.

Runs in the worker process (forked by the zygote, re-parented to the agent). Order matters:
become a session leader; wait until the agent is the parent, then ask for SIGKILL when it dies
(asking earlier would fire when the zygote's intermediate child exits); restore default signal
dispositions; point stdin at /dev/null and stdout/stderr at files or the inherited console,
unbuffered as ``python -u``; take the worker's environment, argv, cwd and ``sys.path[0]`` as a
fresh interpreter would; reseed what a fresh interpreter seeds from the OS; then run the target
with ``runpy`` as ``__main__``. Exceptions and ``SystemExit`` propagate to the interpreter's
top level, so exit codes, tracebacks and atexit handlers behave as in a cold start. A standby
(see ``zygote``) waits for its parent first, then for its request, and does the rest when it
comes; its worker's start is then the request's time (``UNBROKEN_WORKER_STARTED``).
"""

from __future__ import annotations

import ctypes
import io
import os
import runpy
import select
import signal
import sys
import time
from typing import Any

from unbroken.env import UNBROKEN_WORKER_STARTED

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
_libc: Any = None


def load_libc() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _prctl(option: int, arg: int) -> int:
    return int(load_libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0))


def set_pdeathsig(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux)."""
    try:
        return _prctl(PR_SET_PDEATHSIG, signum) == 0
    except (OSError, AttributeError):
        return False


def set_child_subreaper() -> bool:
    """Make orphaned descendants this process's children (Linux >= 3.4)."""
    try:
        return _prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError):
        return False


def is_child_subreaper() -> bool:
    try:
        value = ctypes.c_int(0)
        ok = load_libc().prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0
        return bool(ok and value.value == 1)
    except (OSError, AttributeError):
        return False


def await_parent(agent_pid: int, *, gate_fd: int | None = None, timeout_s: float = 10.0) -> None:
    """Wait to be the agent's child, then die with it. ``gate_fd`` (from the warm pool) reads
    EOF when the intermediate that forked this worker exits: blocking on it, not polling, keeps
    a node's waiting workers off the CPUs while the pool forks the rest."""
    deadline = time.monotonic() + timeout_s
    if gate_fd is not None:
        try:
            while select.select([gate_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if not os.read(gate_fd, 64):
                    break
        finally:
            os.close(gate_fd)
    while os.getppid() != agent_pid:
        if time.monotonic() > deadline:
            os._exit(70)  # never re-parented to the agent: it is gone or not a subreaper
        time.sleep(0.0002)
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != agent_pid:  # the agent died between the check and the prctl
        os._exit(70)


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (
        signal.SIGTERM,
        signal.SIGCHLD,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    ):
        signal.signal(sig, signal.SIG_DFL)


def _redirect(fd: int, path: str | None, flags: int) -> None:
    if path is None:
        return
    target = os.open(path, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _unbuffered_stdio() -> None:
    """sys.stdout/stderr as ``python -u`` builds them: text over raw, write-through."""
    for name, fd, errors in (("stdout", 1, "strict"), ("stderr", 2, "backslashreplace")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw,
            encoding=getattr(sys, name).encoding or "utf-8",  # type: ignore[arg-type]
            errors=errors,
            write_through=True,
            line_buffering=False,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.__stdin__ = sys.stdin  # type: ignore[misc]


def _reseed() -> None:
    """What a fresh interpreter would have: numpy's legacy global state from OS entropy, torch's
    default generator at its initial seed. (``random`` reseeds itself after fork.)"""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.manual_seed(torch.default_generator.initial_seed())


def become_worker(req: dict[str, Any], *, agent_pid: int) -> None:
    """Everything before the user's code; see the module docstring."""
    os.setsid()
    await_parent(agent_pid, gate_fd=req.get("gate_fd"))
    _reset_signals()
    _redirect(0, os.devnull, os.O_RDONLY)
    append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    _redirect(1, req.get("stdout"), append)
    _redirect(2, req.get("stderr"), append)
    _unbuffered_stdio()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if "activated" in req:  # a standby: the worker starts now, not when the process did
        os.environ[UNBROKEN_WORKER_STARTED] = f"{os.getpid()}:{req['activated']}"
    _reseed()


def run_target(req: dict[str, Any]) -> None:
    """Run the entrypoint as ``__main__`` (returns when it returns; exceptions propagate)."""
    kind, target, args = req["kind"], req["target"], list(req["args"])
    if kind == "module":
        sys.argv = [target, *args]  # run_module replaces argv[0] with the module's path
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "script":
        path = os.path.abspath(target)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(path)
        runpy.run_path(path, run_name="__main__")
    else:
        raise ValueError(f"the warm pool runs Python only, not {kind!r}")
