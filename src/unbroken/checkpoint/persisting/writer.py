"""The persistent checkpoint writer: one process per rank, started once by its trainer.

Run as ``python -m unbroken.checkpoint.persisting.writer`` (a plain subprocess, not multiprocessing, so
the trainer needs no ``__main__`` guard). It talks to its trainer over one Unix socket (see
``protocol``) and reads staged tensors from the shared arena the trainer hands it.

For each save it writes this rank's DCP data file into ``step-N.partial/`` (one
``torch.save`` record per tensor, exactly as ``FileSystemWriter`` lays them out, with a CRC-32
computed on the way), fsyncs it, and drops its done record. Rank 0's writer is the coordinator:
it then waits for every rank's record and publishes the checkpoint (``commit.publish``).

It never outlives its trainer: PR_SET_PDEATHSIG kills it with its parent, a watchdog thread
exits when the parent pid changes, and the main loop exits at the socket's end of stream. It
is background work: a session (and so an autogroup) of its own at the lowest share, SCHED_IDLE
and its niceness (``lower_priority``), so that where cores are short the trainers get them.

Fault and test hooks (``hooks.WriterHooks``) come from the trainer as a message; the writer
reads no control file or environment variable of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import io
import logging
import mmap
import os
import pickle
import signal
import socket
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from unbroken.checkpoint import layout  # none imports torch
from unbroken.checkpoint.persisting import protocol
from unbroken.checkpoint.persisting.hooks import NO_HOOKS, WriterHooks
from unbroken.log import init_logging

logger = logging.getLogger("unbroken.checkpoint.persisting.writer")

_PR_SET_PDEATHSIG = 1
_WRITE_SLICE = 4 << 20
_BUFFER = 1 << 20
_ABORT_CHECK_BYTES = 64 << 20


def _die_with_parent(parent_pid: int, *, pdeathsig: bool) -> None:
    if pdeathsig:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on the watchdog")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watchdog, name="writer-watchdog", daemon=True).start()


def preload() -> None:
    """Import everything a save needs (torch and DCP included). A forked writer must import
    nothing: another thread of its trainer may have been inside an import as it forked, and
    that module's lock stays held in the child (whose only thread is the forking one), so the
    child would wait for it forever. The forking trainer calls this first; a spawned writer
    calls it before it says "ready"."""
    import torch
    from torch.distributed.checkpoint import filesystem, storage  # noqa: F401

    import unbroken.checkpoint.persisting.commit  # noqa: F401  (imports DCP's planner and metadata)
    import unbroken.checkpoint.staging.arena  # noqa: F401  (a save's slots unpickle into it)

    torch.save(torch.empty(0), io.BytesIO())  # torch.save imports more on its first use


class _Abort(Exception):
    """Another rank skipped or failed this step: stop writing it."""


@functools.cache
def _crc_thread() -> ThreadPoolExecutor:
    """One thread for the CRC-32 of large writes (zlib releases the GIL while it sums)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-writer-crc")


class ChecksumWriter(io.RawIOBase):
    """A write-only stream over a file descriptor that computes CRC-32 and can cap the rate.

    ``torch.save`` writes a tensor's archive in dozens of pieces (headers, the pickle, the
    central directory) and flushes once at its end: the pieces are gathered in a buffer (up to
    ``_BUFFER`` bytes) and written with one system call at that flush, which saves the writer
    a system call per piece. A tensor's bytes go out in slices, each slice's CRC summed on
    another thread while the next one is written (summing takes a fifth of the write here).
    Call ``flush`` before the data must be in the file (``fsync``)."""

    def __init__(self, fd: int, *, bytes_per_s: float, check: Any = None) -> None:
        super().__init__()
        self.fd = fd
        self.crc = 0
        self._buf = bytearray()
        self._written = 0
        self._rate = bytes_per_s
        self._t0 = time.monotonic()
        self._check = check
        self._since_check = 0
        self.os_error: OSError | None = None
        """The storage's error (ENOSPC, EROFS, EIO), which torch.save's writer would hide
        behind its own ("unexpected pos")."""

    def writable(self) -> bool:
        return True

    @property
    def pos(self) -> int:
        """Bytes written so far, buffered ones included."""
        return self._written + len(self._buf)

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if len(self._buf) + n <= _BUFFER:
            self._buf += view
            return n
        self.flush()
        self._out(view)
        return n

    def flush(self) -> None:
        if self._buf:
            buf, self._buf = self._buf, bytearray()
            self._out(memoryview(buf))

    def close(self) -> None:
        """Drop what is buffered without writing it: ``IOBase`` closes (and so flushes) a
        stream when it is collected, and after a failed save the descriptor is closed and its
        number may already belong to another file."""
        self._buf = bytearray()
        super().close()

    def _out(self, view: memoryview) -> None:
        n = len(view)
        last: Future[None] | None = None
        try:
            for start in range(0, n, _WRITE_SLICE):
                piece = view[start : start + _WRITE_SLICE]
                chunk = piece
                while chunk:
                    try:
                        chunk = chunk[os.write(self.fd, chunk) :]
                    except OSError as e:
                        self.os_error = e
                        raise
                if n > _WRITE_SLICE:  # its CRC on the other thread, while the next piece is written
                    last = _crc_thread().submit(self._add_crc, piece)
                else:
                    self._add_crc(piece)
                self._account(len(piece))
        finally:
            if last is not None:  # one thread, in order: the last one ends after all the others
                last.result()  # ``view`` may not outlive this call (torch.save's buffers)

    def _add_crc(self, piece: memoryview) -> None:
        self.crc = zlib.crc32(piece, self.crc)

    def _account(self, nbytes: int) -> None:
        """``nbytes`` more are written: hold the rate cap, check for an abandoned save."""
        self._written += nbytes
        self._since_check += nbytes
        if self._rate > 0:
            ahead = self._t0 + self._written / self._rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        if self._check is not None and self._since_check >= _ABORT_CHECK_BYTES:
            self._since_check = 0
            self._check()


class Writer:
    """Serves one trainer's messages until it closes the socket or says "close"."""

    def __init__(self, args: argparse.Namespace, sock: socket.socket) -> None:
        import torch

        preload()  # before "ready": the persist timeout starts then
        torch.serialization.set_crc32_options(False)  # we checksum whole files ourselves
        self.torch = torch
        self.args = args
        self.sock = sock
        self.root = Path(args.root)
        self.rank = args.rank
        self.world_size = args.world_size
        self.mm: mmap.mmap | None = None
        self.layouts: dict[int, list[tuple[Any, Any]]] = {}
        self.hooks: WriterHooks = NO_HOOKS
        self.step = -1

    # --- messages ----------------------------------------------------------------------------
    def reply(self, msg: dict[str, Any]) -> None:
        protocol.send(self.sock, msg)

    def serve(self) -> None:
        self.reply({"type": "ready", "pid": os.getpid()})
        while True:
            try:
                msg, fds = protocol.recv(self.sock)
            except (protocol.PeerGone, ConnectionError):
                return
            kind = msg["type"]
            if kind == "arena":
                self._map(fds[0], msg["size"])
            elif kind == "layout":
                self.layouts = {msg["layout_id"]: msg["entries"]}
            elif kind == "hooks":
                self.hooks = msg["hooks"]
            elif kind == "save":
                self._save(msg)
            elif kind == "close":
                return
            else:  # pragma: no cover - protocol bug
                raise AssertionError(kind)

    def _map(self, fd: int, size: int) -> None:
        if self.mm is not None:
            self.mm.close()
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)

    def at(self, point: str) -> None:
        """A point of the commit protocol (``hooks.POINTS``) in the save of ``self.step``."""
        self.hooks.at(point, root=self.root, step=self.step)

    # --- one save ----------------------------------------------------------------------------
    def _save(self, msg: dict[str, Any]) -> None:
        from unbroken.checkpoint.persisting import commit

        step = self.step = msg["step"]
        part = layout.partial_dir(self.root, step)
        begin = time.time()
        try:
            record = self._persist(msg, part)
        except _Abort as e:
            self.reply({"type": "abandoned", "step": step, "reason": str(e)})
            return
        except Exception as e:
            logger.exception("writer of rank %d failed to persist step %d", self.rank, step)
            with contextlib.suppress(OSError):  # free what it took (a full disk), then say so
                (part / layout.data_file(self.rank)).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                layout.write_marker(part / layout.fail_marker(self.rank), {"error": repr(e)})
            self.reply({"type": "failed", "step": step, "error": f"{type(e).__name__}: {e}"})
            return
        end = time.time()
        self.reply(
            {
                "type": "persisted",
                "step": step,
                "begin": begin,
                "end": end,
                "bytes": record["bytes"],
                "write_s": record["write_s"],
                "fsync_s": record["fsync_s"],
                "rss_bytes": _rss_bytes(),
                "throttle_bytes_per_s": record["throttle_bytes_per_s"],
            }
        )
        if self.rank != 0:
            return
        try:
            deadline = begin + self.args.commit_timeout_s
            records = commit.wait_for_ranks(
                part, world_size=self.world_size, deadline=deadline, at=self.at
            )
            removed = commit.publish(
                self.root, step=step, records=records, keep=self.args.keep, at=self.at
            )
        except commit.Abandoned as e:
            layout.write_marker(part / layout.ABANDONED, {"reason": str(e)})
            self.reply({"type": "abandoned", "step": step, "reason": str(e)})
            return
        except Exception as e:
            logger.exception("coordinator failed to commit step %d", step)
            with contextlib.suppress(OSError):
                layout.write_marker(part / layout.ABANDONED, {"reason": repr(e)})
            self.reply({"type": "failed", "step": step, "error": f"{type(e).__name__}: {e}"})
            return
        self.reply(
            {
                "type": "committed",
                "step": step,
                "begin": end,
                "end": time.time(),
                "path": str(layout.step_dir(self.root, step)),
                "removed": removed,
            }
        )

    def _persist(self, msg: dict[str, Any], part: Path) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult

        from unbroken.checkpoint.persisting import commit

        torch = self.torch
        part.mkdir(parents=True, exist_ok=True)

        def check() -> None:
            why = commit.abandon_reason(part)
            if why:
                raise _Abort(why)

        for stale in (layout.done_record(self.rank), layout.fail_marker(self.rank)):
            (part / stale).unlink(missing_ok=True)  # of an earlier, interrupted save
        check()
        entries = self.layouts[msg["layout_id"]]
        base = msg.get("base", 0)  # the arena region the save was staged in
        rate = self._rate()
        name = layout.data_file(self.rank)
        t0 = time.monotonic()
        # A retired checkpoint's file of this rank, written over in place (``layout``).
        recycled = layout.claim_recycled(self.root, name, part / name)
        flags = os.O_WRONLY | os.O_CREAT | (0 if recycled else os.O_TRUNC)
        fd = os.open(part / name, flags, 0o644)
        try:
            stream = ChecksumWriter(fd, bytes_per_s=rate, check=check)
            items, results = [], []

            def add(wi: Any, offset: int) -> None:
                length = stream.tell() - offset
                items.append(wi)
                results.append(
                    WriteResult(
                        index=wi.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )

            for wi, payload in msg["payloads"]:
                offset = stream.tell()
                stream.write(payload)
                add(wi, offset)
            half = len(entries) // 2
            for i, (wi, slot) in enumerate(entries):
                if i == half:
                    self.at("data")
                offset = stream.tell()
                assert self.mm is not None
                # A tensor whose storage is exactly this slot, so torch.save writes only it.
                raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=slot.nbytes, offset=base + slot.offset) \
                    if slot.nbytes else torch.empty(0, dtype=torch.uint8)  # fmt: skip
                try:
                    torch.save(raw.view(slot.dtype).view(slot.shape), stream)
                except RuntimeError as e:
                    err = stream.os_error
                    if err is None:
                        raise
                    raise OSError(err.errno, err.strerror, str(part / name)) from e
                add(wi, offset)
            stream.flush()
            if recycled:
                os.ftruncate(fd, stream.pos)
            t1 = time.monotonic()
            self.reply({"type": "written", "step": msg["step"]})  # the arena is free again
            os.fsync(fd)
            t2 = time.monotonic()
        finally:
            os.close(fd)
        check()
        record = {
            "rank": self.rank,
            "step": msg["step"],
            "items": items,
            "results": results,
            "assigned": msg["assigned"],
            "planner_data": msg["planner_data"],
            "files": {name: layout.file_entry(stream.pos, stream.crc)},
            "run": msg.get("run"),
        }
        layout.write_durable(part / layout.done_record(self.rank), pickle.dumps(record))
        return {
            "bytes": stream.pos,
            "write_s": t1 - t0,
            "fsync_s": t2 - t1,
            "throttle_bytes_per_s": rate,
        }

    def _rate(self) -> float:
        """This save's write-rate cap in bytes/s (0: none): the configured one, lowered by the
        hooks' cap for this save (a slow-storage fault in force)."""
        rate = float(self.args.throttle_bytes_per_s)
        slow = self.hooks.save_rate(root=self.root, rank=self.rank, step=self.step)
        if slow is not None:
            logger.warning(
                "rank %d: storage slowed to %.2f MB/s by a slow-storage fault (step %d)",
                self.rank,
                slow / 1e6,
                self.step,
            )
            rate = slow if rate <= 0 else min(rate, slow)
        return rate


def lower_priority(nice: int, *, idle: bool = False) -> None:
    """The writer is background work: where cores are short, training gets them first.

    Linux shares the CPU between autogroups (one per session, where the kernel has them on)
    before it weighs a process's niceness or policy, so both stop at the trainer's session:
    a persisting writer then takes its share from the *other* ranks' trainers. So the writer
    leaves its trainer's session for one of its own, whose autogroup (the writer alone) gets
    the lowest share, niceness 19; then ``nice`` is added to its own niceness, and with
    ``idle`` it runs as SCHED_IDLE (on what the trainers leave). Where the ranks take every
    core, each of the three takes less from the step after a durable save than the one before
    it, and persisting takes longer (``unbroken bench writer`` compares them)."""
    if not nice and not idle:
        return
    with contextlib.suppress(OSError):  # a session leader already (a spawned writer run alone)
        os.setsid()
    _autogroup_nice(19)
    if nice:
        os.nice(nice)
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError) as e:  # not Linux
            logger.debug("SCHED_IDLE unavailable: %s", e)


def _autogroup_nice(nice: int) -> None:
    """Give this session's autogroup ``nice``; nothing where the kernel has no autogroups. An
    unprivileged caller may set one only every 100 ms machine-wide: retried for 0.5 s."""
    for _ in range(5):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return
        except BlockingIOError:
            time.sleep(0.1)
        except OSError as e:  # no autogroups here (or not allowed): niceness alone
            logger.debug("autogroup niceness not set: %s", e)
            return
    logger.debug("autogroup niceness not set: busy for 0.5 s")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unbroken.checkpoint.persisting.writer")
    p.add_argument("--fd", type=int, required=True, help="the socket to the trainer")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--pdeathsig", action="store_true")
    p.add_argument("--root", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--keep", type=int, required=True)
    p.add_argument("--commit-timeout-s", type=float, required=True)
    p.add_argument("--throttle-bytes-per-s", type=float, default=0.0)
    p.add_argument("--nice", type=int, default=0, help="niceness to add (background work)")
    p.add_argument("--idle", action="store_true", help="run as SCHED_IDLE (background work)")
    args = p.parse_args(argv)
    _die_with_parent(args.parent_pid, pdeathsig=args.pdeathsig)
    lower_priority(args.nice, idle=args.idle)
    init_logging(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    sock = socket.socket(fileno=args.fd)
    try:
        Writer(args, sock).serve()
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
