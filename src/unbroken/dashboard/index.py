"""A run's records grouped by kind, grown as records arrive, so a refresh reads only the kinds
it needs instead of walking every record of a long run again."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger.events import Event

REF = 0  # the reference rank, as in unbroken report


class EventIndex:
    """Every record (alerts excluded) in arrival order, by kind, and the span they cover."""

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self.all: list[Event] = []
        self.by_kind: dict[str, list[Event]] = {}
        self.ref_steps: list[Event] = []
        """Reference-rank step records with a step number, sorted by ``ts``."""
        self._ref_ts: list[float] = []
        self.t0 = float("inf")
        self.t1 = float("-inf")
        self.add(events)

    def add(self, events: Iterable[Event]) -> None:
        for e in events:
            if e.kind == ev.ALERT:
                continue
            self.all.append(e)
            self.by_kind.setdefault(e.kind, []).append(e)
            self.t0 = min(self.t0, e.begin)
            self.t1 = max(self.t1, e.ts)
            if e.kind == ev.STEP and e.rank == REF and e.get("step") is not None:
                if not self._ref_ts or e.ts >= self._ref_ts[-1]:
                    self._ref_ts.append(e.ts)
                    self.ref_steps.append(e)
                else:  # another file's record from earlier
                    i = bisect.bisect_right(self._ref_ts, e.ts)
                    self._ref_ts.insert(i, e.ts)
                    self.ref_steps.insert(i, e)

    def kinds(self, *kinds: str) -> list[Event]:
        out: list[Event] = []
        for k in kinds:
            out.extend(self.by_kind.get(k, ()))
        return out

    def since(self, ts: float) -> list[Event]:
        """Records ending at or after ``ts`` (a scan of every record)."""
        return [e for e in self.all if e.ts >= ts]

    def __len__(self) -> int:
        return len(self.all)

    @classmethod
    def of(cls, events: Iterable[Event] | EventIndex) -> EventIndex:
        return events if isinstance(events, EventIndex) else cls(events)

    def get(self, kind: str) -> list[Any]:
        return self.by_kind.get(kind, [])
