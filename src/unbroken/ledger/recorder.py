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

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Recorder(Protocol):
    """A per-process goodput event stream (see ``unbroken.ledger.writer.Ledger``)."""

    run: str
    """The run id stamped on every record ("" when unknown)."""

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> object:
        """Record one event.

        Args:
            kind: One of ``unbroken.ledger.events.KINDS``.
            ts: When it happened, epoch seconds (None: now).
            **data: Its kind-specific fields.

        Returns:
            The record (``Event``), or None where nothing is recorded.
        """
        ...

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
            lazy: Write it with the next record that is written (the training thread's step
                record) rather than wake a thread for it: for a per-step record of the
                training thread, where a thread woken every step takes the interpreter lock
                from the step.
            **data: Its kind-specific fields.
        """
        ...

    def step(self, step: int, **data: Any) -> None:
        """Record a completed training step; its interval starts at the last boundary.

        Args:
            step: The step completed.
            **data: More fields of its record (``loss=...``).
        """
        ...

    def mark(self, ts: float | None = None) -> None:
        """Set the step boundary: the next ``step`` record's interval starts here.

        Args:
            ts: The boundary, epoch seconds (None: now).
        """
        ...

    def phase(self, name: str, **data: Any) -> AbstractContextManager[None]:
        """Record the enclosed block as a phase; moves the step boundary to its end.

        Args:
            name: The phase's name (``unbroken.ledger.events.PHASES``, or a user's).
            **data: More fields of its record.

        Returns:
            A context manager around the block.
        """
        ...

    def set_context(
        self, *, rank: int | None = None, attempt: int | None = None, iteration: int | None = None
    ) -> None:
        """Change what is stamped on later records; None leaves a field as it is.

        Args:
            rank: The global rank.
            attempt: The launcher attempt.
            iteration: The in-process iteration.
        """
        ...

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record emitted so far is written.

        Args:
            timeout_s: How long at most.

        Returns:
            False on timeout.
        """
        ...


class NullRecorder(Recorder):
    """A ``Recorder`` that records nothing (no run directory). Subclass it for test fakes.

    Its methods do what ``Recorder``'s say, recording nothing: ``emit`` returns None and
    ``flush`` True.
    """

    run = ""

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> object:
        return None

    def interval(
        self,
        kind: str,
        *,
        begin: float,
        end: float | None = None,
        lazy: bool = False,
        **data: Any,
    ) -> None:
        return None

    def step(self, step: int, **data: Any) -> None:
        return None

    def mark(self, ts: float | None = None) -> None:
        return None

    def phase(self, name: str, **data: Any) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def set_context(
        self, *, rank: int | None = None, attempt: int | None = None, iteration: int | None = None
    ) -> None:
        return None

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True


NULL: Recorder = NullRecorder()
"""The shared ``NullRecorder`` (it holds no state)."""
