"""The per-process append-only ledger writer.

``emit`` puts a record on a queue and returns (a few microseconds); a background thread writes
queued records to ``<run_dir>/events/<host>-p<pid>-<incarnation>.jsonl`` with one ``os.write`` per
batch on an ``O_APPEND`` descriptor, so a written record is in the kernel's page cache at once.

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
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger.busy import BusyClock
from unbroken.ledger.phases import check_name
from unbroken.mask import masked

logger = logging.getLogger(__name__)

_STOP = object()
_WAKE = object()  # flush: write what waits in the lazy list now

LAZY_PHASE_S = 0.5
"""A phase shorter than this is queued without waking the writer: the next record that wakes it
(the step's) takes it along, one wake-up a step instead of two (a thread wake-up costs the
rank 0.1-0.3 ms of CPU on a loaded machine). A longer phase (a validation) wakes it at once."""


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
        self.rank = rank
        self.attempt = attempt
        self.iteration = iteration
        self._fsync_interval_s = fsync_interval_s
        events_dir = Path(run_dir) / "events"
        events_dir.mkdir(parents=True, exist_ok=True)
        self.path = events_dir / file_name()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lazy: collections.deque[ev.Event] = collections.deque()
        self._enqueued = 0
        self._written = 0
        self._cond = threading.Condition()
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
        with self._cond:
            self._enqueued += 1
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
        self.emit(ev.STEP, ts=now, step=step, dur_s=max(0.0, now - self._mark), **data)
        self._mark = now

    @contextmanager
    def phase(self, name: str, **data: Any) -> Iterator[None]:
        """Record the enclosed block as a phase; moves the step boundary to its end.

        Args:
            name: The phase's name (``unbroken.ledger.events.PHASES``, or a user's).
            **data: More fields of its record.

        Raises:
            ValueError: For a user's phase name that is not valid.
        """
        if name not in ev.PHASES:
            check_name(name)  # a user's phase (``RestartContext.phase``)
        begin = time.time()
        yield
        end = time.time()
        lazy = end - begin < LAZY_PHASE_S
        self.interval(ev.PHASE, begin=begin, end=end, lazy=lazy, name=name, **data)
        self._mark = end
        self._busy.reset()

    # --- durability --------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record emitted so far is written.

        Args:
            timeout_s: How long at most.

        Returns:
            False on timeout.
        """
        deadline = time.monotonic() + timeout_s
        if self._lazy:
            self._queue.put(_WAKE)
        with self._cond:
            target = self._enqueued
            while self._written < target and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._written >= target

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
            batch: list[ev.Event] = []
            while self._lazy:  # emitted before what woke the writer
                batch.append(self._lazy.popleft())
            if item is _STOP:
                stop = True
            elif item is not None and item is not _WAKE:
                batch.append(item)
            while True:  # drain what is already queued into one write
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                elif nxt is not _WAKE:
                    batch.append(nxt)
            while stop and self._lazy:  # the last ones
                batch.append(self._lazy.popleft())
            if batch:
                self._write(batch)
            now = time.monotonic()
            if stop or (now - last_sync >= self._fsync_interval_s):
                self._fsync()
                last_sync = now
        self._fsync()
        os.close(self._fd)

    def _write(self, batch: list[ev.Event]) -> None:
        payload = "".join(e.to_json() + "\n" for e in batch).encode()
        try:
            view = memoryview(payload)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            logger.exception("ledger write to %s failed; %d records lost", self.path, len(batch))
        with self._cond:
            self._written += len(batch)
            self._cond.notify_all()

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError:
            logger.warning("fsync of %s failed", self.path)


def open_for_process(
    run_dir: Path, *, run: str, rank: int, attempt: int, started: float, **fields: Any
) -> Ledger:
    """The ledger of a training process, opened as each opens it (``unbroken.run``, the
    observer of a plain script): its directory made, the SIGTERM flush installed, its
    ``process_start`` record (``ts`` = ``started``; ``pid``, ``host``, ``python`` and
    ``fields``), the ``import`` phase from ``started`` to now, the step boundary, and after a
    launcher restart (``attempt`` > 0) the restart's end."""
    import platform

    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(run_dir, run=run, rank=rank, attempt=attempt)
    install_sigterm_flush(ledger)
    ledger.emit(
        ev.PROCESS_START,
        ts=started,
        pid=os.getpid(),
        host=socket.gethostname(),
        python=platform.python_version(),
        **fields,
    )
    ledger.interval(ev.PHASE, begin=started, name="import")
    ledger.mark()
    if attempt > 0:
        ledger.emit(ev.RESTART_END, layer="launcher")
    return ledger


def record_failure(ledger: Ledger, error: BaseException, *, fault_rank: int) -> None:
    """The error that ends a training process, as the fault its peers and the launcher will
    see (``fault_detected``, detector "exception")."""
    ledger.emit(
        ev.FAULT_DETECTED,
        cause=type(error).__name__,
        detector="exception",
        fault_rank=fault_rank,
        message=str(error)[:500],
    )


_takers: list[Callable[[], bool]] = []


@contextlib.contextmanager
def sigterm_taken_by(taker: Callable[[], bool]) -> Iterator[None]:
    """While the block runs, a SIGTERM that ``taker()`` takes (returns True: it stops the
    process its own way, e.g. a graceful preemption) neither closes the ledger nor ends the
    process (``install_sigterm_flush``). ``taker`` may run on any thread; keep it cheap.

    Args:
        taker: Asked at each SIGTERM.
    """
    _takers.append(taker)
    try:
        yield
    finally:
        _takers.remove(taker)


def _taken() -> bool:
    try:
        return any(taker() for taker in list(_takers))
    except Exception:  # a taker that breaks takes nothing: SIGTERM ends the process as before
        logger.exception("a SIGTERM taker failed")
        return False


def install_sigterm_flush(ledger: Ledger) -> None:
    """On SIGTERM: close the ledger (writing every record), then die of SIGTERM as before
    (unless a ``sigterm_taken_by`` taker takes it).

    Prompt even when the main thread is blocked in native code (a collective, a store wait),
    where a Python signal handler only runs once that call returns: the interpreter's C-level
    handler writes the signal number to a wakeup fd, and a small thread reading it closes the
    ledger and re-raises SIGTERM with the default action. Falls back to a plain Python handler
    when the wakeup fd is taken (e.g. by asyncio), and chains to a Python handler already
    installed. Main thread only (elsewhere it does nothing).

    Args:
        ledger: The ledger to close.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        if _taken():
            return
        ledger.close()
        if callable(previous):
            previous(signum, frame)
            return
        _die_of_sigterm()

    signal.signal(signal.SIGTERM, handler)
    if callable(previous):
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # pragma: no cover - not the main thread of the main interpreter
        old_fd = -2
    if old_fd != -1:  # someone else's: give it back and rely on the Python handler
        if old_fd >= 0:
            signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)
        return

    def watch() -> None:
        while True:
            data = os.read(r, 64)
            if not data or (signal.SIGTERM in data and not _taken()):
                break
        ledger.close()
        _die_of_sigterm()

    threading.Thread(target=watch, name="unbroken-sigterm", daemon=True).start()


def _die_of_sigterm() -> None:
    """End the process by SIGTERM's default action, from any thread."""
    import ctypes

    try:  # signal.signal() is main-thread only; the C library's is process-wide
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal(ctypes.c_int(signal.SIGTERM), ctypes.c_void_p(0))  # SIG_DFL
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    finally:
        os._exit(128 + signal.SIGTERM)
