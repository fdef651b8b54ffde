"""The trainer's handle on its writer process: start it, send it work, hear back, notice death.

A reader thread blocks on the socket; every message it receives goes to ``on_message`` (from
that thread). End of stream means the writer is gone: its exit status is collected and
``on_death`` is called at once, so a death is noticed in milliseconds, never by a timeout.
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
from typing import Any

from unbroken.checkpoint import protocol
from unbroken.checkpoint.config import CheckpointError

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
        on_message: Callable[[dict[str, Any]], None],
        on_death: Callable[[str], None],
    ) -> None:
        self._on_message = on_message
        self._on_death = on_death
        self._send_lock = threading.Lock()
        self._closing = False
        self.spawn_ts = time.time()
        self.ready_ts: float | None = None
        """When the writer said it was ready (it imports torch first: seconds)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-m",
            "unbroken.checkpoint.writer",
            "--fd",
            str(theirs.fileno()),
            "--parent-pid",
            str(os.getpid()),
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
        ]
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits; only ask for it
        # from the main thread, which lives as long as the process.
        if threading.current_thread() is threading.main_thread():
            cmd.append("--pdeathsig")
        try:
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
