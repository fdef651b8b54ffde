"""Stopping the main thread from another thread, and telling whether it executes Python at all.

Interrupts are asynchronous exceptions (``PyThreadState_SetAsyncExc``): the main thread raises
``RestartInterrupt`` at its next bytecode boundary check. A main thread blocked in native code
(a collective, a lock) raises it only when that call returns; ``pg.close_transport`` is what
makes a blocked collective return.

Delivery is confined to ``fn``: the main thread calls ``fn`` through ``_call_fn``, and an
interrupt is only delivered while that frame is on the main thread's stack below the innermost
frame (checked under a lock that ``invoke`` takes on its way out). So at most one interrupt
can still be pending when ``fn`` returns; ``invoke`` catches or clears it, and nothing of
``run``'s own code is ever interrupted. An interrupt that user code swallows (``except
BaseException``, a ``finally`` that raises another error, an ``__del__``) is simply delivered
again at the next monitor tick, until ``fn`` has returned.

The probe: ``Py_AddPendingCall`` schedules a C function (``sem_post``) that only the main
thread runs, at its next bytecode boundary check. No Python runs for it, so it cannot disturb
an interrupt in flight; if the semaphore was not posted since the last probe, the main thread
executed no Python in between (it is in native code: a collective, a sleep, a deadlock).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from unbroken.restart.config import RestartInterrupt

logger = logging.getLogger(__name__)

T = TypeVar("T")

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
_set_async_exc.restype = ctypes.c_int


def _call_fn(fn: Callable[[Any], T], ctx: Any) -> T:
    """The frame that marks "inside fn" on the main thread's stack; does nothing else."""
    return fn(ctx)


_TRAMPOLINE = _call_fn.__code__


def _in_fn(thread_ident: int) -> bool:
    """True when ``_call_fn`` is on the thread's stack and is not its innermost frame."""
    frame = sys._current_frames().get(thread_ident)
    if frame is None or frame.f_code is _TRAMPOLINE:
        return False
    frame = frame.f_back
    while frame is not None:
        if frame.f_code is _TRAMPOLINE:
            return True
        frame = frame.f_back
    return False


def _raise_in(thread_ident: int, exc_type: type[BaseException] | None) -> None:
    """Set (or, with None, clear) the thread's pending asynchronous exception."""
    _set_async_exc(thread_ident, None if exc_type is None else id(exc_type))


@dataclass(frozen=True)
class Invocation:
    """How one call of ``fn`` ended."""

    value: Any = None
    """fn's return value (None unless it returned)."""
    error: BaseException | None = None
    """What fn raised, or None when it returned."""


class Interrupter:
    """Calls ``fn`` in the main thread; other threads interrupt it while it runs."""

    def __init__(self) -> None:
        self.main_ident = threading.main_thread().ident or 0
        self._lock = threading.Lock()
        self._in_fn = False
        self.delivered = 0
        """Interrupts delivered so far (for the ledger and tests)."""

    def invoke(self, fn: Callable[[Any], Any], ctx: Any) -> Invocation:
        """Call ``fn(ctx)`` in the main thread and return how it ended; never raises."""
        if threading.get_ident() != self.main_ident:
            raise RuntimeError("unbroken.restart.run must be called from the main thread")
        outcome: Invocation | None = None
        with self._lock:
            self._in_fn = True
        try:
            try:
                outcome = Invocation(value=_call_fn(fn, ctx))
            except BaseException as e:  # noqa: BLE001 - every way fn ends is an outcome
                outcome = Invocation(error=e)
            self._leave()
        except RestartInterrupt as e:  # the one interrupt still pending as fn returned
            if outcome is None:
                outcome = Invocation(error=e)
            self._leave()
        return outcome

    def _leave(self) -> None:
        with self._lock:
            self._in_fn = False
        _raise_in(self.main_ident, None)

    def interrupt(self) -> bool:
        """From another thread: raise RestartInterrupt in fn if it is running; True if sent."""
        with self._lock:
            if not self._in_fn or not _in_fn(self.main_ident):
                return False
            _raise_in(self.main_ident, RestartInterrupt)
            self.delivered += 1
            return True


class PythonProbe:
    """Tells whether the main thread executed Python since the previous ``poll``.

    Call ``poll`` from one thread only, periodically. Falls back to "always executing" where
    ``sem_post`` or ``Py_AddPendingCall`` are not available.
    """

    def __init__(self) -> None:
        self.last_python = time.monotonic()
        """Monotonic time at which the main thread was last seen executing Python."""
        self._outstanding = False
        self._libc: Any = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._sem = ctypes.create_string_buffer(64)  # >= sizeof(sem_t) on every glibc
            if libc.sem_init(self._sem, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "sem_init failed")
            self._post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
            self._add = ctypes.pythonapi.Py_AddPendingCall
            self._add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self._add.restype = ctypes.c_int
            self._libc = libc
        except (OSError, AttributeError) as e:
            logger.info("main-thread probe unavailable (%s); native stalls look like Python", e)

    def poll(self, now: float) -> float:
        """Probe; returns seconds since the main thread last executed Python."""
        if self._libc is None:
            self.last_python = now
            return 0.0
        if self._outstanding and self._libc.sem_trywait(self._sem) == 0:
            self._outstanding = False
            self.last_python = now
        if not self._outstanding:
            self._outstanding = self._add(self._post, ctypes.addressof(self._sem)) == 0
        return now - self.last_python

    def reset(self, now: float) -> None:
        """Forget past silence (e.g. at the start of an iteration)."""
        self.last_python = now


_probe: PythonProbe | None = None
_probe_lock = threading.Lock()


def python_probe() -> PythonProbe:
    """The process's probe. Never freed: a pending call may still post its semaphore."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = PythonProbe()
        return _probe
