"""``StorageHealth``: whether this rank's checkpoint storage is failing, since when, and when
a durable save is tried next.

A failed save (the writer reported an error, the save stalled past ``persist_timeout_s``, the
writer died or never became ready) is a storage failure, never an exception in the training
step. ``failed`` records it and backs off: durable saves are held back ``storage_retry_s``,
doubled with each further failure up to ``storage_retry_max_s``, and the saves held back are
memory snapshots only (``Saves.stage``). The first save that succeeds (``succeeded``) ends the
failing period; how long it lasted is the time this rank ran unprotected by a durable
checkpoint. Under ``on_storage_failure="stop"``, ``final_due`` says when the period has lasted
``storage_failure_limit_s``: the next save is the final attempt, waited for.

Thread-safe: the writer client's reader thread reports outcomes, the training thread asks.
Imports of ours: ``checkpoint.config``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from unbroken.checkpoint.config import CheckpointConfig


@dataclass(frozen=True)
class StorageStatus:
    """This rank's checkpoint storage as its saves saw it (``Checkpointer.storage``)."""

    failing_since: float | None
    """When the current failing period began (epoch seconds); None: storage is healthy."""
    failures: int
    """Saves failed in a row in the current failing period."""
    total_failures: int
    """Saves failed over this Checkpointer's life."""
    last_error: str | None
    """The newest failure's message."""
    next_attempt_ts: float | None
    """While failing: the earliest time the next durable save is attempted."""
    unprotected_s: float
    """Time spent in failing periods (the current one up to now): no durable checkpoint
    newer than the period's start was made."""

    @property
    def failing(self) -> bool:
        """True while a failing period lasts."""
        return self.failing_since is not None


class StorageHealth:
    """The failing periods of one rank's checkpoint storage, and the back-off between attempts.

    Args:
        config: The Checkpointer's settings (``storage_retry_s``, ``storage_retry_max_s``,
            ``on_storage_failure``, ``storage_failure_limit_s``).
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._since: float | None = None
        self._failures = 0
        self._total = 0
        self._error: str | None = None
        self._retry_at: float | None = None
        self._closed_s = 0.0

    @property
    def failing(self) -> bool:
        """True while a failing period lasts."""
        return self._since is not None

    def failed(self, error: str, *, now: float | None = None) -> float:
        """Record a failed save.

        Args:
            error: What failed, as the ledger records it.
            now: The time of the failure (default: now).

        Returns:
            The back-off in seconds before the next durable save is attempted.
        """
        now = time.time() if now is None else now
        with self._lock:
            if self._since is None:
                self._since = now
            self._failures += 1
            self._total += 1
            self._error = error
            backoff = min(
                self.config.storage_retry_s * 2 ** (self._failures - 1),
                self.config.storage_retry_max_s,
            )
            self._retry_at = now + backoff
            return backoff

    def succeeded(self, *, now: float | None = None) -> float | None:
        """Record a save that persisted (committed on rank 0).

        Args:
            now: The time it became durable (default: now).

        Returns:
            The length of the failing period it ended, or None when storage was healthy.
        """
        now = time.time() if now is None else now
        with self._lock:
            if self._since is None:
                return None
            period = max(0.0, now - self._since)
            self._closed_s += period
            self._since, self._failures, self._retry_at = None, 0, None
            return period

    def hold(self, *, now: float | None = None) -> str | None:
        """Why a durable save due now is held back (a reason for ``ckpt_skip``), or None.

        Args:
            now: The time of the save (default: now).

        Returns:
            None when the save should be attempted.
        """
        now = time.time() if now is None else now
        with self._lock:
            if self._since is None or self._retry_at is None or now >= self._retry_at:
                return None
            return (
                f"storage failing for {now - self._since:.1f} s ({self._failures} failed "
                f"in a row, last: {self._error}); next attempt in {self._retry_at - now:.1f} s"
            )

    def final_due(self, *, now: float | None = None) -> bool:
        """Whether the next save is the final attempt (``on_storage_failure="stop"``).

        Args:
            now: The time of the save (default: now).

        Returns:
            True when storage has failed for ``storage_failure_limit_s`` under "stop".
        """
        now = time.time() if now is None else now
        with self._lock:
            return (
                self.config.on_storage_failure == "stop"
                and self._since is not None
                and now - self._since >= self.config.storage_failure_limit_s
            )

    def status(self, *, now: float | None = None) -> StorageStatus:
        """A snapshot of the counters.

        Args:
            now: The time the current period is counted to (default: now).

        Returns:
            The status as of ``now``.
        """
        now = time.time() if now is None else now
        with self._lock:
            current = 0.0 if self._since is None else max(0.0, now - self._since)
            return StorageStatus(
                failing_since=self._since,
                failures=self._failures,
                total_failures=self._total,
                last_error=self._error,
                next_attempt_ts=self._retry_at,
                unprotected_s=self._closed_s + current,
            )
