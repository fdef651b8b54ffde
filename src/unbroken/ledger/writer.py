"""The per-process append-only ledger writer.

``emit`` puts a record on a queue and returns (a few microseconds); a background thread writes
queued records to ``<run_dir>/events/<host>-p<pid>-<incarnation>.jsonl`` with one ``os.write`` per
batch on an ``O_APPEND`` descriptor, so a written record is in the kernel's page cache at once.
The training thread's own per-step records (``step``, and the phases before it) it writes
itself, at once, on a local file system: no thread is woken for them, and none is lost to a
SIGKILL after ``step`` returns. On a network file system, while the writer thread is in a write
or an fsync, or after one of these writes was slow (storage that stalls), they are queued
instead, so storage never holds up a step.

What can be lost:
- SIGKILL of the process: only records still in the queue, i.e. emitted in the last few
  milliseconds (the writer thread wakes on every put; the bound is the interpreter's thread
  switch interval, 5 ms, while the main thread holds the GIL), and a short phase's record
  whose step has not ended (``LAZY_PHASE_S``). Call ``flush()`` before an action that may kill
  the process (the fault injector does).
- A machine crash: records written since the last fsync, at most ``fsync_interval_s``.
- SIGTERM and normal exit lose nothing: ``close()`` runs from atexit and from the SIGTERM handler
  installed by ``install_sigterm_flush()``.
A torn last line (a write cut by a crash) is skipped by the reader.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger.busy import BusyClock
from unbroken.ledger.phases import check_name
from unbroken.mask import masked

logger = logging.getLogger(__name__)

_STOP = object()
_Raw = tuple[str, float, int, int, int, dict[str, Any]]
"""A record queued by ``Ledger._raw``: kind, ts, rank, attempt, iteration, data."""


class _Flush:
    """A flush's marker in the queue: set once every record queued before it is written."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


SYNC_WRITE_LIMIT_S = 0.005
"""A step record the training thread wrote itself that took longer than this (storage that
stalls) sends its records through the writer thread for ``SYNC_PAUSE_S``."""
SYNC_PAUSE_S = 60.0

LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs", "overlay"}
)
"""File systems whose writes to the page cache never wait on a network: the training thread
writes its step records itself only there (``local_file_system``)."""

LAZY_PHASE_S = 0.5
"""A phase shorter than this waits to be written with the next step's record (or the next
wake-up of the writer thread); a longer one (a validation) is written at once."""


def local_file_system(path: Path, mountinfo: str | None = None) -> bool:
    """Whether ``path`` lies on one of ``LOCAL_FILE_SYSTEMS`` (its mount in
    ``/proc/self/mountinfo``, or ``mountinfo``'s text): a network file system (NFS, Lustre,
    a FUSE mount) can make a write wait on a server, which the training thread must not."""
    try:
        target = str(path.resolve())
        text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
        best, kind = "", ""
        for line in text.splitlines():
            left, _, right = line.partition(" - ")
            mount = left.split()[4].replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):  # the deepest; a later one mounted over it
                best, kind = mount, right.split()[0]
        return kind in LOCAL_FILE_SYSTEMS
    except (OSError, IndexError):
        return False


def process_start_time() -> float:
    """When this process was created. (A worker that waited as a warm-pool standby started
    later: ``unbroken.env.standby_start``.)

    ``/proc/stat``'s boot time is whole seconds, so it is not used: the age of the process is
    ``uptime - starttime`` (both in 10 ms resolution), subtracted from now.

    Returns:
        Epoch seconds (Linux /proc), else now.
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        # Field 22 (starttime, clock ticks since boot); fields after the ')' of comm.
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        now = time.time()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        return now - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()


def file_name() -> str:
    """This process's ledger file name, ``<host>-p<pid>-<incarnation>.jsonl``.

    The incarnation (this boot's id and the process's start tick) keeps two processes apart
    that share host name and pid: a replacement pod (same hostname, pid 1 again) writing to the
    same shared volume. It is fixed for the life of the process.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:6]
        ticks = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
        incarnation = f"{boot}{int(ticks):x}"
    except (OSError, ValueError, IndexError):
        incarnation = f"{int(process_start_time() * 1000):x}"
    return f"{socket.gethostname()}-p{os.getpid()}-{incarnation}.jsonl"


class Ledger:
    """Append-only goodput event stream of one process: ``<run_dir>/events/<file>.jsonl``,
    written and fsynced by a thread of its own.

    Not thread-safe for ``set_context``; ``emit`` may be called from any thread.

    Args:
        run_dir: The run directory.
        run: The run id stamped on every record.
        rank: The global rank stamped on records (-1: a launcher agent).
        attempt: The launcher attempt stamped on records.
        iteration: The in-process iteration stamped on records.
        fsync_interval_s: The file is fsynced at least this often while records come.

    Raises:
        ValueError: When ``fsync_interval_s`` is not > 0.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        run: str,
        rank: int,
        attempt: int = 0,
        iteration: int = 0,
        fsync_interval_s: float = 1.0,
    ) -> None:
        if fsync_interval_s <= 0:
            raise ValueError(f"fsync_interval_s must be > 0, got {fsync_interval_s}")
        self.run = run
        self._run_json = json.dumps(run)
        self.rank = rank
        self.attempt = attempt
        self.iteration = iteration
        self._fsync_interval_s = fsync_interval_s
        events_dir = Path(run_dir) / "events"
        events_dir.mkdir(parents=True, exist_ok=True)
        self.path = events_dir / file_name()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._sync_writes = local_file_system(events_dir)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lazy: collections.deque[ev.Event | _Raw] = collections.deque()
        self._fd_lock = threading.Lock()  # the descriptor is closed under it
        self._in_io = False  # the writer thread is in a write or an fsync
        self._sync_paused_until = 0.0
        self._closed = False
        self._mark = time.time()
        self._busy = BusyClock()
        self._thread = threading.Thread(target=self._run, name="unbroken-ledger", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # --- context -----------------------------------------------------------------------------
    def set_context(
        self, *, rank: int | None = None, attempt: int | None = None, iteration: int | None = None
    ) -> None:
        """Change what is stamped on later records; None leaves a field as it is.

        Args:
            rank: The global rank.
            attempt: The launcher attempt.
            iteration: The in-process iteration.
        """
        if rank is not None:
            self.rank = rank
        if attempt is not None:
            self.attempt = attempt
        if iteration is not None:
            self.iteration = iteration

    # --- emitting ----------------------------------------------------------------------------
    @masked
    def emit(
        self, kind: str, *, ts: float | None = None, lazy: bool = False, **data: Any
    ) -> ev.Event:
        """Queue one record; never blocks on I/O. Masked (``unbroken.mask``): a restart
        interrupt never leaves a record half-queued.

        Args:
            kind: One of ``unbroken.ledger.events.KINDS``.
            ts: When it happened, epoch seconds (None: now).
            lazy: Do not wake the writer for it: the next record that does (or ``flush``, or
                the writer's periodic wake-up) writes it.
            **data: Its kind-specific fields.

        Returns:
            The record (queued, or dropped once the ledger is closed).
        """
        event = ev.Event(
            kind=kind,
            ts=time.time() if ts is None else ts,
            run=self.run,
            rank=self.rank,
            attempt=self.attempt,
            iteration=self.iteration,
            data=data,
        )
        if self._closed:
            logger.debug("ledger closed; dropping %s record", kind)
            return event
        if lazy:
            self._lazy.append(event)
        else:
            self._queue.put(event)
        return event

    def interval(
        self,
        kind: str,
        *,
        begin: float,
        end: float | None = None,
        lazy: bool = False,
        **data: Any,
    ) -> None:
        """Record an interval ``[begin, end]``.

        Args:
            kind: One of ``unbroken.ledger.events.KINDS``.
            begin: Its start, epoch seconds.
            end: Its end (None: now).
            lazy: As for ``emit``.
            **data: Its kind-specific fields.
        """
        end = time.time() if end is None else end
        if lazy and kind in ev.KINDS:  # a per-step record: queued as a tuple, no Event built
            data["dur_s"] = max(0.0, end - begin)
            self._raw(kind, end, data, lazy=True)
            return
        self.emit(kind, ts=end, lazy=lazy, dur_s=max(0.0, end - begin), **data)

    def mark(self, ts: float | None = None) -> None:
        """Set the step boundary: the next ``step`` record's interval starts here.

        Args:
            ts: The boundary, epoch seconds (None: now).
        """
        self._mark = time.time() if ts is None else ts
        self._busy.reset()

    def step(self, step: int, **data: Any) -> None:
        """Record a completed training step; its interval starts at the previous boundary.
        Adds ``busy_s`` (``busy.BusyClock``: the calling thread's run + run-queue time since
        that boundary) when it is known and ``data`` has none.

        Args:
            step: The step completed.
            **data: More fields of its record (``loss=...``).
        """
        busy = self._busy.lap()
        if busy is not None:
            data.setdefault("busy_s", round(busy, 6))
        now = time.time()
        data["step"] = step
        data["dur_s"] = max(0.0, now - self._mark)
        self._raw(ev.STEP, now, data, lazy=False)
        self._mark = now

    def _raw(self, kind: str, ts: float, data: dict[str, Any], *, lazy: bool) -> None:
        """A record of the training thread's per-step calls (``step``, a phase), of a known
        kind (ValueError for a field named like a common one). A lazy one waits in the lazy
        list. Another is written by the
        calling thread at once, with the lazy ones before it (``_write_now``), unless the
        ledger is on a network file system, the writer thread is in a write or an fsync, or
        storage was slow lately: then queued."""
        if not ev.COMMON_FIELDS.isdisjoint(data):
            ev.Event(kind=kind, data=data)  # raises, saying which
        if self._closed:
            return
        item = (kind, ts, self.rank, self.attempt, self.iteration, data)
        if lazy:
            self._lazy.append(item)
        elif self._sync_writes and not self._in_io and time.monotonic() >= self._sync_paused_until:
            self._write_now(item)
        else:
            self._queue.put(item)

    @masked
    def _write_now(self, item: _Raw) -> None:
        """Write ``item`` (and the lazy list) on the calling thread: a step's record is in the
        page cache when ``step`` returns, and no thread is woken for it (nor hands the
        interpreter lock back and forth with the training thread, a step)."""
        batch: list[ev.Event | _Raw] = []
        with contextlib.suppress(IndexError):  # the writer thread may drain it meanwhile
            while self._lazy:
                batch.append(self._lazy.popleft())
        batch.append(item)
        t0 = time.monotonic()
        with self._fd_lock:
            if self._closed:
                return
            self._write(batch)
        took = time.monotonic() - t0
        if took > SYNC_WRITE_LIMIT_S:
            self._sync_paused_until = time.monotonic() + SYNC_PAUSE_S
            logger.info(
                "a ledger write took %.3f s: step records go through the writer thread for %.0f s",
                took,
                SYNC_PAUSE_S,
            )

    def phase(self, name: str, **data: Any) -> _Phase:
        """Record the enclosed block as a phase; moves the step boundary to its end. A block
        that raises is not recorded.

        Args:
            name: The phase's name (``unbroken.ledger.events.PHASES``, or a user's).
            **data: More fields of its record.

        Returns:
            A context manager around the block (a class, not a generator: it runs every step,
            where each call's code runs cold after the step's compute).

        Raises:
            ValueError: For a user's phase name that is not valid.
        """
        if name not in ev.PHASES:
            check_name(name)  # a user's phase (``RestartContext.phase``)
        return _Phase(self, name, data)

    def _phase_ended(self, name: str, begin: float, data: dict[str, Any]) -> None:
        end = time.time()
        data["name"] = name
        data["dur_s"] = max(0.0, end - begin)
        self._raw(ev.PHASE, end, data, lazy=end - begin < LAZY_PHASE_S)
        self._mark = end
        self._busy.reset()

    # --- durability --------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record emitted so far is written.

        Args:
            timeout_s: How long at most.

        Returns:
            False on timeout (or when the writer thread ended without a ``close``).
        """
        deadline = time.monotonic() + timeout_s
        marker = _Flush()
        self._queue.put(marker)
        while not marker.done.wait(max(0.0, min(0.1, deadline - time.monotonic()))):
            if not self._thread.is_alive():
                return self._closed  # a close wrote everything queued before its stop
            if time.monotonic() >= deadline:
                return False
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write everything queued, fsync, and stop the writer thread. Idempotent; every caller
        (a signal handler racing a normal exit, say) returns only once the writing is done.

        Args:
            timeout_s: How long to wait for the writer thread at most.
        """
        self._stop()
        self._busy.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @masked
    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            with contextlib.suppress(Exception):  # interpreter shutdown
                atexit.unregister(self.close)

    # --- the writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        last_sync = time.monotonic()
        stop = False
        while not stop:
            try:
                item = self._queue.get(timeout=self._fsync_interval_s)
            except queue.Empty:
                item = None
            batch: list[ev.Event | _Raw] = []
            flushes: list[_Flush] = []
            while self._lazy:  # emitted before what woke the writer
                batch.append(self._lazy.popleft())
            while item is not None:  # this one, then what is already queued: one write
                if item is _STOP:
                    stop = True
                elif isinstance(item, _Flush):
                    flushes.append(item)
                else:
                    batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            while (stop or flushes) and self._lazy:  # the last ones, or a flush's
                batch.append(self._lazy.popleft())
            if batch:
                self._in_io = True
                self._write(batch)
                self._in_io = False
            for flush in flushes:
                flush.done.set()
            now = time.monotonic()
            if stop or (now - last_sync >= self._fsync_interval_s):
                self._in_io = True
                self._fsync()
                self._in_io = False
                last_sync = now
        self._fsync()
        # Not while the training thread writes (the descriptor's number could be reused under
        # it); that thread may be the one closing, from a signal handler: then it stays open.
        if self._fd_lock.acquire(timeout=1.0):
            try:
                os.close(self._fd)
            finally:
                self._fd_lock.release()

    def _write(self, batch: list[ev.Event | _Raw]) -> None:
        lines = []
        for item in batch:
            if type(item) is tuple:
                line = ev.plain_json(self._run_json, *item)
                if line is None:
                    kind, ts, rank, attempt, iteration, data = item
                    line = ev.Event(
                        kind=kind,
                        ts=ts,
                        run=self.run,
                        rank=rank,
                        attempt=attempt,
                        iteration=iteration,
                        data=data,
                    ).to_json()
                lines.append(line)
            else:
                lines.append(item.to_json())  # type: ignore[union-attr]
        payload = ("\n".join(lines) + "\n").encode()
        try:
            view = memoryview(payload)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            logger.exception("ledger write to %s failed; %d records lost", self.path, len(batch))

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError:
            logger.warning("fsync of %s failed", self.path)


class _Phase:
    """``Ledger.phase``'s context manager."""

    __slots__ = ("_ledger", "_name", "_data", "_begin")

    def __init__(self, ledger: Ledger, name: str, data: dict[str, Any]) -> None:
        self._ledger = ledger
        self._name = name
        self._data = data
        self._begin = 0.0

    def __enter__(self) -> None:
        self._begin = time.time()

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._ledger._phase_ended(self._name, self._begin, self._data)
