"""``Recorder``: the one thing every recording component needs of a ledger, and ``NULL``.

Everything that records goodput events (the Checkpointer, the fault injector, the in-process
restart, the launcher agent) takes a ``Recorder``. ``unbroken.ledger.Ledger`` is the real one;
``NULL`` (a ``NullRecorder``) records nothing and stands in where there is no run directory,
so that a component never checks for "no ledger" itself. Tests pass recording fakes (a
subclass of ``NullRecorder`` overriding what they watch).

Contract of every method: it never blocks on I/O and never raises for a well-formed call
(``flush`` waits, bounded by its timeout); ``emit`` and ``interval`` may be called from any
thread; ``set_context``, ``mark``, ``step`` and ``phase`` from the training thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol


class Recorder(Protocol):
    """A per-process goodput event stream (see ``unbroken.ledger.writer.Ledger``)."""

    run: str
    """The run id stamped on every record ("" when unknown)."""

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> object:
        """Record one event of ``kind`` at ``ts`` (default: now) with ``data``."""
        ...

    def interval(self, kind: str, *, begin: float, end: float | None = None, **data: Any) -> None:
        """Record an interval ``[begin, end]`` (end defaults to now)."""
        ...

    def step(self, step: int, **data: Any) -> None:
        """Record a completed training step; its interval starts at the last boundary."""
        ...

    def mark(self, ts: float | None = None) -> None:
        """Set the step boundary: the next ``step`` record's interval starts here."""
        ...

    def phase(self, name: str, **data: Any) -> AbstractContextManager[None]:
        """Record the enclosed block as phase ``name``; moves the step boundary to its end."""
        ...

    def set_context(
        self, *, rank: int | None = None, attempt: int | None = None, iteration: int | None = None
    ) -> None:
        """Change the rank, launcher attempt or in-process iteration stamped on later records."""
        ...

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record emitted so far is written; False on timeout."""
        ...


class NullRecorder:
    """A ``Recorder`` that records nothing (no run directory). Subclass it for test fakes."""

    run = ""

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> object:
        return None

    def interval(self, kind: str, *, begin: float, end: float | None = None, **data: Any) -> None:
        return None

    def step(self, step: int, **data: Any) -> None:
        return None

    def mark(self, ts: float | None = None) -> None:
        return None

    @contextmanager
    def phase(self, name: str, **data: Any) -> Iterator[None]:
        yield

    def set_context(
        self, *, rank: int | None = None, attempt: int | None = None, iteration: int | None = None
    ) -> None:
        return None

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True


NULL: Recorder = NullRecorder()
"""The shared ``NullRecorder`` (it holds no state)."""
