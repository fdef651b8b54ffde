"""A recording ledger for unit tests of code that takes a ``Recorder``."""

from __future__ import annotations

from typing import Any

from unbroken.ledger import NullRecorder


class Sink(NullRecorder):
    """Keeps every ``emit`` as (kind, data) and counts ``flush`` calls."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.flushes = 0

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> None:
        self.events.append((kind, data))

    def flush(self, timeout_s: float = 5.0) -> bool:
        self.flushes += 1
        return True
