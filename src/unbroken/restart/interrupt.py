"""Stopping the main thread from another thread, and telling whether it executes Python at all.

An interrupt is a simulated signal: ``interrupt`` (from any thread) trips a real-time signal
number with ``_thread.interrupt_main``. The kernel sends nothing, so no system call of the
main thread is disturbed; the main thread runs the handler at its next bytecode boundary
check, like any Python signal handler. A main thread blocked in native code (a collective, a
lock) runs it only when that call returns; ``pg.close_transport`` is what makes a blocked
collective return.

The handler decides in the main thread, with the interrupted frame in hand:

- outside ``fn`` (no ``_call_fn`` frame on the stack below the innermost one: fn has not
  started, or has returned): nothing happens, so nothing of ``run``'s own code is interrupted;
- inside a function decorated ``unbroken.mask.masked`` (cleanup that must complete: aborting
  a Checkpointer, a ledger record, the monitor's lock): deferred, and raised as that function
  returns; inside a lock method of ``threading.Condition`` (a few bytecodes): dropped, and the
  monitor's next interrupt lands after it, so that no ``with`` statement is left holding a
  lock whose ``__exit__`` will never run;
- else: ``RestartInterrupt`` is raised there.

Deciding there, and not in the thread that asked, is what makes masking exact: an
asynchronous exception (``PyThreadState_SetAsyncExc``) is raised at the next check whatever
the main thread entered in between, e.g. the first bytecode of a cleanup function.

An interrupt that user code swallows (``except BaseException``, a ``finally`` that raises
another error, an ``__del__``) is simply delivered again at the next monitor tick, until
``fn`` has returned.

The probe: ``Py_AddPendingCall`` schedules a C function (``sem_post``) that only the main
thread runs, at its next bytecode boundary check. No Python runs for it, so it cannot disturb
an interrupt in flight; if the semaphore was not posted since the last probe, the main thread
executed no Python in between (it is in native code: a collective, a sleep, a deadlock).
"""

from __future__ import annotations

import _thread
import ctypes
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, TypeVar

from unbroken.mask import MASKED_CODE, deferral
from unbroken.restart.config import RestartInterrupt

logger = logging.getLogger(__name__)

T = TypeVar("T")

SIGNAL = signal.SIGRTMAX - 3
"""The signal number the interrupt trips (never sent by the kernel; see the module docstring)."""

_RETRY_CODES: frozenset[CodeType] = frozenset(
    f.__code__ for f in (threading.Condition.__enter__, threading.Condition.__exit__)
)
"""Lock methods an interrupt must not split (acquired but ``__enter__`` not returned)."""

_OUTSIDE, _INSIDE, _MASKED, _RETRY = range(4)


def _call_fn(fn: Callable[[Any], T], ctx: Any) -> T:
    """The frame that marks "inside fn" on the main thread's stack; does nothing else."""
    return fn(ctx)


_TRAMPOLINE = _call_fn.__code__


def _where(frame: FrameType | None) -> int:
    """Where ``frame`` (the main thread's innermost) is: outside fn, inside it, masked, or in
    a lock method to retry after."""
    if frame is None or frame.f_code is _TRAMPOLINE:
        return _OUTSIDE
    where = _INSIDE
    while frame is not None:
        code = frame.f_code
        if code is _TRAMPOLINE:
            return where
        if code is MASKED_CODE:
            where = _MASKED
        elif code in _RETRY_CODES and where == _INSIDE:
            where = _RETRY
        frame = frame.f_back
    return _OUTSIDE


@dataclass(frozen=True)
class Invocation:
    """How one call of ``fn`` ended."""

    value: Any = None
    """fn's return value (None unless it returned)."""
    error: BaseException | None = None
    """What fn raised, or None when it returned."""


_active: Interrupter | None = None
"""The Interrupter whose ``fn`` runs now (the handler's target)."""


def _handler(signum: int, frame: FrameType | None) -> None:
    intr = _active
    if intr is None or not intr.requested:
        return
    where = _where(frame)
    if where == _MASKED:
        deferral.pending = True
    elif where == _INSIDE:  # _RETRY: the monitor's next interrupt lands after the method
        intr.delivered += 1
        raise RestartInterrupt


def _on_masked_return() -> None:
    """A masked function returns with an interrupt pending: raise it now, unless an outer
    masked function is still running (it raises it when it returns)."""
    intr = _active
    if intr is None or threading.get_ident() != intr.main_ident:
        return
    caller = sys._getframe(2)  # this <- masked_call <- its caller
    where = _where(caller)
    if where == _MASKED:
        return
    deferral.pending = False
    if where != _OUTSIDE and intr.requested:
        intr.delivered += 1
        raise RestartInterrupt


class Interrupter:
    """Calls ``fn`` in the main thread; other threads interrupt it while it runs."""

    def __init__(self) -> None:
        self.main_ident = threading.main_thread().ident or 0
        self._lock = threading.Lock()
        self._in_fn = False
        self.requested = False
        """An interrupt was asked for in this call of fn (it is delivered until fn returns)."""
        self.delivered = 0
        """Interrupts raised in fn so far (for the ledger and tests)."""

    def invoke(self, fn: Callable[[Any], Any], ctx: Any) -> Invocation:
        """Call ``fn(ctx)`` in the main thread and return how it ended; never raises."""
        global _active
        if threading.get_ident() != self.main_ident:
            raise RuntimeError("unbroken.restart.run must be called from the main thread")
        if signal.getsignal(SIGNAL) is not _handler:
            signal.signal(SIGNAL, _handler)
        deferral.on_return = _on_masked_return
        _active = self
        self._enter(True)
        try:
            outcome = Invocation(value=_call_fn(fn, ctx))
        except BaseException as e:  # noqa: BLE001 - every way fn ends is an outcome
            outcome = Invocation(error=e)
        self._enter(False)
        return outcome

    def _enter(self, in_fn: bool) -> None:
        with self._lock:
            self._in_fn = in_fn
            self.requested = False
        deferral.pending = False

    def interrupt(self) -> bool:
        """From another thread: interrupt fn if it is running (see the module docstring);
        True if asked. It lands when the main thread next checks, or is deferred."""
        with self._lock:
            if not self._in_fn:
                return False
            self.requested = True
        _thread.interrupt_main(SIGNAL)  # type: ignore[arg-type]  # any signal number goes
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
