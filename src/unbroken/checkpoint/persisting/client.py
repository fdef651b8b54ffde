"""The trainer's handle on its writer process: start it, send it work, hear back, notice death.

A reader thread blocks on the socket; every message it receives goes to ``on_message`` (from
that thread). End of stream means the writer is gone: its exit status is collected and
``on_death`` is called at once, so a death is noticed in milliseconds, never by a timeout.

Two ways to start the writer (``start``):

* ``"fork"`` (default where the trainer has already imported torch): ``os.fork`` of the trainer.
  Ready in milliseconds, because torch is already in memory. Spawning instead costs a torch
  import (seconds, more while the ranks train on the same cores) — paid at every
  in-process restart and every relaunch, during which the first saves are skipped and steps are
  lost. The child replaces every inherited descriptor but its socket and stdio with /dev/null
  (so it holds no peer connection or store socket open, and no inherited Python object can
  close a descriptor the writer opened later), freezes every inherited object out of the
  garbage collector (no destructor of the trainer's runs in it), resets signal handlers, runs the writer and
  leaves with ``os._exit`` (no atexit handler of the trainer runs twice). Only the forking
  thread exists in the child, so a lock another thread held as it forked stays held there:
  the trainer imports everything the writer needs before forking (``writer.preload``), so the
  child imports nothing (a module being imported by another thread keeps its import lock
  held); Python re-creates the global import lock, logging's locks and the buffered stdio
  locks in the child itself; the writer uses no other lock another thread could hold (I/O,
  pickle, ``torch.save`` of CPU tensors; never CUDA) — the same contract as DataLoader
  workers. ``tests/unit/test_checkpoint_fork.py`` forks while other threads hold each of
  these.
  Inside ``forkserver.serving()`` (``unbroken.run``, the reference script) the fork is the
  fork server's, of a copy of the trainer made before its model: the writer then shares no
  page the trainer writes (``forkserver``); the trainer signals it by pid and hears how it
  ended from the server.
* ``"spawn"``: a fresh interpreter (``python -m unbroken.checkpoint.persisting.writer``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from unbroken.checkpoint.config import CheckpointError, WriterStart
from unbroken.checkpoint.persisting import forkserver, protocol

logger = logging.getLogger(__name__)

_PKG_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `unbroken`


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _fork_writer(argv: list[str], sock_fd: int) -> int:
    """Fork a writer serving ``sock_fd`` from this process; its pid (see the module docstring)."""
    from unbroken.checkpoint.persisting import writer

    writer.preload()
    pid = os.fork()
    if pid:
        return pid
    forkserver.run_writer(argv, sock_fd=sock_fd)


class _ForkedProcess(forkserver.PolledProcess):
    """A child made with ``os.fork``: this process reaps it."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere
                    self.returncode = -1
                    return self.returncode
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


def default_start() -> Literal["fork", "spawn"]:
    """``fork`` when this process has torch in memory (a trainer), else ``spawn``."""
    return "fork" if "torch" in sys.modules and hasattr(os, "fork") else "spawn"


class WriterClient:
    """One writer process. ``send`` may be called from any thread."""

    def __init__(
        self,
        *,
        root: Path,
        rank: int,
        world_size: int,
        keep: int,
        commit_timeout_s: float,
        throttle_bytes_per_s: float,
        nice: int,
        idle: bool = False,
        start: WriterStart = "auto",
        on_message: Callable[[dict[str, Any]], None],
        on_death: Callable[[str], None],
    ) -> None:
        self._on_message = on_message
        self._on_death = on_death
        self._send_lock = threading.Lock()
        self._closing = False
        self.spawn_ts = time.time()
        self.ready_ts: float | None = None
        """When the writer said it was ready (spawned, it imports torch first: seconds)."""
        self.start = default_start() if start == "auto" else start  # checked by the config
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        args = [
            "--fd",
            str(theirs.fileno()),
            "--root",
            str(root),
            "--rank",
            str(rank),
            "--world-size",
            str(world_size),
            "--keep",
            str(keep),
            "--commit-timeout-s",
            str(commit_timeout_s),
            "--throttle-bytes-per-s",
            str(throttle_bytes_per_s),
            "--nice",
            str(nice),
            *(["--idle"] if idle else []),
        ]
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits; only ask for it
        # from the main thread, which lives as long as the process.
        pdeathsig = ["--pdeathsig"] if threading.current_thread() is threading.main_thread() else []
        self.proc: subprocess.Popen[bytes] | forkserver.PolledProcess
        try:
            server = forkserver.current() if self.start == "fork" else None
            served = None
            if server is not None:  # the server's only thread forks: it may always ask
                try:
                    served = server.fork_writer(
                        [*args, "--parent-pid", str(server.pid), "--pdeathsig"], theirs.fileno()
                    )
                except CheckpointError as e:
                    logger.warning("%s; forking the writer from the trainer", e)
            if served is not None:
                assert server is not None
                self.proc = forkserver.ServedProcess(server, served)
            elif self.start == "fork":
                own = [*args, "--parent-pid", str(os.getpid()), *pdeathsig]
                self.proc = _ForkedProcess(_fork_writer(own, theirs.fileno()))
            else:
                env = dict(os.environ)
                env["PYTHONPATH"] = _PKG_ROOT + os.pathsep + env.get("PYTHONPATH", "")
                own = [*args, "--parent-pid", str(os.getpid()), *pdeathsig]
                cmd = [sys.executable, "-m", "unbroken.checkpoint.persisting.writer", *own]
                self.proc = subprocess.Popen(
                    cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env
                )
        finally:
            theirs.close()
        self.sock = ours
        self.pid = self.proc.pid
        self._reader = threading.Thread(
            target=self._read, name=f"unbroken-ckpt-reader-{rank}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                msg, fds = protocol.recv(self.sock)
                for fd in fds:  # the writer never sends fds; do not leak any
                    os.close(fd)
                if msg["type"] == "ready":
                    self.ready_ts = time.time()
                else:
                    self._on_message(msg)
        except (protocol.PeerGone, OSError):
            pass
        except Exception:  # a bug in a handler must not hide a later death
            logger.exception("checkpoint reader thread failed")
        if self._closing:
            return
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        self._on_death(f"checkpoint writer process {self.pid} {describe_exit(code)}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg: dict[str, Any], *, fds: tuple[int, ...] = ()) -> None:
        with self._send_lock:
            try:
                protocol.send(self.sock, msg, fds=fds)
            except OSError as e:
                raise CheckpointError(
                    f"cannot reach checkpoint writer process {self.pid} "
                    f"({describe_exit(self.proc.poll())}): {e}"
                ) from e

    def kill_nowait(self) -> None:
        """SIGKILL the writer without waiting (a process stuck in I/O may take a while to go);
        ``close`` reaps it. Its death is not reported: the caller already knows."""
        self._closing = True
        if self.alive():
            self.proc.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the writer to exit (it finishes the message it is on), then reap it."""
        self._closing = True
        if self.alive():
            try:
                with self._send_lock:
                    protocol.send(self.sock, {"type": "close"})
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("checkpoint writer %d did not exit; killing it", self.pid)
                self.proc.kill()
        try:  # bounded: a process stuck in uninterruptible I/O dies only when the I/O returns
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.error("checkpoint writer %d is stuck (in I/O?); leaving it", self.pid)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=5.0)
        self.sock.close()
