"""How long a run went unprotected by durable checkpoints (``goodput``'s contract, ``storage``).

A failed save (a full or read-only file system, an I/O error, a persist past its timeout, a
writer that died) does not stop training: the state lives on in the memory tier, but a node
lost now loses everything since the newest commit. The records that tell:

- ``ckpt_fail`` (any rank): a save failed; one with ``phase: "load"`` is a checkpoint rejected
  at restore, no save, and is left out;
- ``ckpt_commit`` (rank 0): a checkpoint became durable;
- ``ckpt_skip`` whose ``reason`` starts with ``STORAGE_FAILING``: a save held back while the
  storage is failing.

Definitions, in one walk over those records by ``ts`` (at equal ``ts`` a commit comes after a
failure, so a failure is *newer* only when its ``ts`` is greater):

- an *unprotected interval* begins at the first ``ckpt_fail`` (on any rank) after the newest
  ``ckpt_commit`` (or after the run's start if there is none), and ends at the next
  ``ckpt_commit``, or at ``t1`` (the run's end: its last record) if none comes;
- ``unprotected_s``: the sum of those intervals;
- ``failing_since``: the begin of the interval still open at ``t1`` (None when the newest
  failure is not newer than the newest commit): the storage is failing now;
- ``failed_saves``: distinct saves among the failures, a save being (attempt, iteration, step)
  (one save failing on every rank counts once; a record without a step counts alone);
- ``saves_held_back``: distinct saves among the held-back skips, alike;
- ``last_error``: the ``error`` of the newest failure.

A pure function over records. Imports of ours: the ledger's ``events``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from unbroken.ledger.events import CKPT_COMMIT, CKPT_FAIL, CKPT_SKIP, Event

STORAGE_FAILING = "storage failing"
"""How the reason of a save held back while the checkpoint storage fails begins."""


@dataclass(frozen=True, kw_only=True)
class StorageFailures:
    """A run's failed saves and the time it went unprotected; see the module docstring."""

    failed_saves: int = 0
    """Distinct saves that failed."""
    saves_held_back: int = 0
    """Distinct saves skipped because the storage was failing."""
    unprotected_s: float = 0.0
    """Seconds from a failure after the newest commit to the next commit (or the run's end)."""
    intervals: list[tuple[float, float]] = field(default_factory=list)
    """The unprotected intervals, (begin, end) in epoch seconds, in order."""
    failing_since: float | None = None
    """Begin of the interval still open at the run's end (epoch seconds); None if none is."""
    last_error: str | None = None
    """The newest failure's error."""

    @property
    def failing(self) -> bool:
        """True when the newest failure is newer than the newest commit."""
        return self.failing_since is not None

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain data (intervals as lists).

        Returns:
            Field name -> value, and ``failing``.
        """
        return {
            "failed_saves": self.failed_saves,
            "saves_held_back": self.saves_held_back,
            "unprotected_s": float(self.unprotected_s),
            "intervals": [[float(b), float(e)] for b, e in self.intervals],
            "failing_since": self.failing_since,
            "failing": self.failing,
            "last_error": self.last_error,
        }


def _save(e: Event) -> tuple[Any, ...]:
    step = e.get("step")
    if step is None:
        return (e.attempt, e.iteration, None, e.rank, e.ts)
    return (e.attempt, e.iteration, step)


def is_save_failure(e: Event) -> bool:
    """Whether ``e`` is a ``ckpt_fail`` of a save (not a checkpoint rejected at restore)."""
    return e.kind == CKPT_FAIL and e.get("phase") != "load"


def storage_failures(events: Iterable[Event], *, t1: float | None = None) -> StorageFailures:
    """The failed saves of a run and the time it went unprotected by durable checkpoints.

    Args:
        events: The run's records, in any order (records of other kinds are ignored).
        t1: The run's end, where an interval no commit closes ends; by default the newest
            ``ts`` among ``events``.

    Returns:
        The figures (all zero, None or empty without a failed save).
    """
    end = float("-inf")
    marks: list[tuple[float, int, Event]] = []  # (ts, 0 failure | 1 commit, record)
    held: set[tuple[Any, ...]] = set()
    for e in events:
        end = max(end, float(e.ts))
        if is_save_failure(e):
            marks.append((float(e.ts), 0, e))
        elif e.kind == CKPT_COMMIT:
            marks.append((float(e.ts), 1, e))
        elif e.kind == CKPT_SKIP and str(e.get("reason", "")).startswith(STORAGE_FAILING):
            held.add(_save(e))
    if t1 is not None:
        end = float(t1)
    marks.sort(key=lambda m: (m[0], m[1]))
    failed: set[tuple[Any, ...]] = set()
    intervals: list[tuple[float, float]] = []
    since: float | None = None
    last: Event | None = None
    for ts, commit, e in marks:
        if commit:
            if since is not None:
                intervals.append((since, ts))
                since = None
            continue
        failed.add(_save(e))
        last = e
        if since is None:
            since = ts
    if since is not None:
        intervals.append((since, max(since, end)))
    return StorageFailures(
        failed_saves=len(failed),
        saves_held_back=len(held),
        unprotected_s=float(sum(b - a for a, b in intervals)),
        intervals=intervals,
        failing_since=since,
        last_error=None if last is None else str(last.get("error", "")) or None,
    )
