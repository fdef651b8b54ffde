"""A training process's ledger: opened the way every one opens it, its SIGTERM flush (which a
graceful preemption may take), and the record of the error that ends it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger.writer import Ledger

logger = logging.getLogger(__name__)


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
