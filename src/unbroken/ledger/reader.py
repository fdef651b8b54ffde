"""Read and merge the ledger files of a run directory."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.ledger.events import Event

logger = logging.getLogger(__name__)


@dataclass
class ReadResult:
    """Events of a run, sorted by time, and what could not be read."""

    events: list[Event] = field(default_factory=list)
    """All records of the run, sorted by ``ts``."""
    files: int = 0
    """Number of ledger files read."""
    torn_lines: int = 0
    """Last lines cut short by a crash (skipped; expected after SIGKILL or power loss)."""
    bad_lines: list[str] = field(default_factory=list)
    """Complete lines that did not parse (file:line); these indicate a bug or tampering."""


def read_run(run_dir: str | Path) -> ReadResult:
    """Merge ``<run_dir>/events/*.jsonl``; raises FileNotFoundError if there is no ledger."""
    events_dir = Path(run_dir) / "events"
    if not events_dir.is_dir():
        raise FileNotFoundError(
            f"no ledger in {run_dir}: expected a directory {events_dir} with *.jsonl files; "
            "pass the --run-dir that the training job wrote to"
        )
    result = ReadResult()
    for path in sorted(events_dir.glob("*.jsonl")):
        result.files += 1
        raw = path.read_bytes()
        lines = raw.split(b"\n")
        # A file that does not end in a newline has a torn last record.
        tail_torn = bool(raw) and not raw.endswith(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            is_last = i == len(lines) - 1
            try:
                result.events.append(Event.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                if is_last and tail_torn:
                    result.torn_lines += 1
                else:
                    result.bad_lines.append(f"{path.name}:{i + 1}")
    if result.bad_lines:
        logger.warning("skipped %d unparsable ledger lines", len(result.bad_lines))
    result.events.sort(key=lambda e: e.ts)
    return result


def read_events(run_dir: str | Path) -> list[Event]:
    """The run's events sorted by time (see ``read_run`` for the details of what was skipped)."""
    return read_run(run_dir).events
