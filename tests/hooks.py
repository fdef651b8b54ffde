"""Checkpoint writer hooks for tests (``unbroken.checkpoint.persisting.hooks.WriterHooks``).

A writer process unpickles these, so this module must be importable there: put ``tests/`` on
the trainer's ``PYTHONPATH`` (a spawned writer inherits it; a forked one has it loaded).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


def paused_marker(root: Path, point: str) -> Path:
    """The file ``PauseAt`` writes (holding the writer's pid) when it stops at ``point``."""
    return root / f".paused-{point}"


@dataclass(frozen=True)
class PauseAt:
    """Stop the writer for good at ``point`` of the save of ``step``, after writing
    ``paused_marker`` (whole: a watcher may read it the moment it exists)."""

    point: str
    step: int

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        return None

    def at(self, point: str, *, root: Path, step: int) -> None:
        if (point, step) != (self.point, self.step):
            return
        marker = paused_marker(root, point)
        tmp = marker.with_name(f"{marker.name}.tmp-{os.getpid()}")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, marker)
        while True:
            time.sleep(1.0)


@dataclass(frozen=True)
class PauseUntil:
    """Stop the writer at ``point`` of the save of ``step`` (writing ``paused_marker``) until
    the file ``go`` exists, then go on."""

    point: str
    step: int
    go: Path

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        return None

    def at(self, point: str, *, root: Path, step: int) -> None:
        if (point, step) != (self.point, self.step):
            return
        marker = paused_marker(root, point)
        tmp = marker.with_name(f"{marker.name}.tmp-{os.getpid()}")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, marker)
        while not self.go.exists():
            time.sleep(0.01)
