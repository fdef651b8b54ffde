"""Read and merge the ledger files of a run directory.

``read_run(run_dir, fold_steps_except=R)`` keeps only rank R's step records as events and
folds every other rank's into a ``StepDigest`` (16 bytes a step instead of an ``Event``, 24
with ``busy_s``): what ``goodput.compute`` reads of them (their spans and busy figures, run
ids, attempts, iterations), so a report of 1024 ranks x 10k steps fits in memory
(``unbroken bench scale`` measures it). Same figures, exactly.
"""

from __future__ import annotations

import json
import logging
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.ledger.events import KINDS, STEP, Event

logger = logging.getLogger(__name__)


_INTS = ("rank", "attempt", "iteration")
# Data fields the report reads as numbers: a record with another type there is not ours.
_NUMBERS = ("dur_s", "busy_s")
_OPT_INTS = ("step",)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def parse_line(line: bytes | str) -> Event:
    """One ledger line as an ``Event``; ValueError for anything that is not a record we wrote
    (see ``checked_record``)."""
    return Event.from_dict(checked_record(line))


def checked_record(line: bytes | str) -> dict[str, Any]:
    """One ledger line as the JSON object of a record; ValueError for anything else.

    A record is a JSON object with a known ``kind`` (a string), a finite number ``ts``, integer
    ``rank``/``attempt``/``iteration`` when present, a finite ``dur_s`` and ``busy_s`` >= 0 and
    an integer (or null) ``step`` when present. Nothing else is raised, whatever the bytes.
    """
    try:
        obj = json.loads(line)
    except RecursionError:
        raise ValueError("a ledger line nested too deeply to be a record") from None
    # json.loads raises ValueError (JSONDecodeError, UnicodeDecodeError) for the rest
    if not isinstance(obj, dict):
        raise ValueError(f"a ledger record is a JSON object, got {type(obj).__name__}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"a ledger record needs a known kind, got {kind!r:.80}")
    if not _is_number(obj.get("ts")):
        raise ValueError(f"a ledger record needs a finite number ts, got {obj.get('ts')!r:.80}")
    for name in _INTS:
        if name in obj and not _is_int(obj[name]):
            raise ValueError(f"a ledger record's {name} is an integer, got {obj[name]!r:.80}")
    for name in _NUMBERS:
        if name in obj and not (_is_number(obj[name]) and obj[name] >= 0):
            raise ValueError(f"a ledger record's {name} is a number >= 0, got {obj[name]!r:.80}")
    for name in _OPT_INTS:
        if obj.get(name) is not None and not _is_int(obj[name]):
            raise ValueError(f"a ledger record's {name} is an integer, got {obj[name]!r:.80}")
    return obj


@dataclass
class StepDigest:
    """The step records of the ranks other than the reference rank, folded."""

    spans: dict[int, array] = field(default_factory=dict)
    """Per rank: begin, end, begin, end, ... (epoch seconds) of each step record, in order."""
    busy: dict[int, array] = field(default_factory=dict)
    """Per rank with ``busy_s`` figures: one per step record, aligned with ``spans`` (NaN
    where a record has none)."""
    runs: Counter[str] = field(default_factory=Counter)
    """Non-empty ``run`` fields, counted."""
    attempts: set[int] = field(default_factory=set)
    max_iteration: int = 0
    t0: float = float("inf")
    """Earliest begin."""
    t1: float = float("-inf")
    """Latest end."""
    count: int = 0

    def add(self, obj: dict[str, Any]) -> None:
        """Fold one step record (a parsed ledger line); raises like ``Event.from_dict``."""
        ts = float(obj["ts"])
        dur = obj.get("dur_s")
        begin = ts - float(dur) if dur is not None else ts
        rank = int(obj.get("rank", 0))
        attempt = int(obj.get("attempt", 0))
        iteration = int(obj.get("iteration", 0))
        run = str(obj.get("run", ""))
        spans = self.spans.setdefault(rank, array("d"))
        spans.extend((begin, ts))
        busy = obj.get("busy_s")
        column = self.busy.get(rank)
        if column is None and _is_number(busy):
            column = self.busy[rank] = array("d", [math.nan]) * (len(spans) // 2 - 1)
        if column is not None:
            column.append(float(busy) if busy is not None and _is_number(busy) else math.nan)
        if run:
            self.runs[run] += 1
        self.attempts.add(attempt)
        self.max_iteration = max(self.max_iteration, iteration)
        self.t0 = min(self.t0, begin)
        self.t1 = max(self.t1, ts)
        self.count += 1


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
    digest: StepDigest | None = None
    """With ``fold_steps_except``: the other ranks' step records, folded (not in ``events``)."""


def read_run(run_dir: str | Path, *, fold_steps_except: int | None = None) -> ReadResult:
    """Merge a run's ledger files, ``<run_dir>/events/*.jsonl``.

    Args:
        run_dir: The run directory.
        fold_steps_except: With a rank R, step records of ranks other than R go to ``digest``
            (pass it to ``goodput.compute``) instead of ``events`` (None: none).

    Returns:
        The events sorted by time, and what was skipped (torn or malformed records).

    Raises:
        FileNotFoundError: When there is no ledger.
    """
    events_dir = Path(run_dir) / "events"
    if not events_dir.is_dir():
        raise FileNotFoundError(
            f"no ledger in {run_dir}: expected a directory {events_dir} with *.jsonl files; "
            "pass the --run-dir that the training job wrote to"
        )
    result = ReadResult()
    digest = result.digest = StepDigest() if fold_steps_except is not None else None
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
                obj = checked_record(line)
                folds = digest is not None and obj["kind"] == STEP
                if folds and int(obj.get("rank", 0)) != fold_steps_except:
                    assert digest is not None
                    digest.add(obj)
                    continue
                result.events.append(Event.from_dict(obj))
            except ValueError:
                if is_last and tail_torn:
                    result.torn_lines += 1
                else:
                    result.bad_lines.append(f"{path.name}:{i + 1}")
    if result.bad_lines:
        logger.warning("skipped %d unparsable ledger lines", len(result.bad_lines))
    result.events.sort(key=lambda e: e.ts)
    return result


def read_events(run_dir: str | Path) -> list[Event]:
    """A run's events (see ``read_run`` for the details of what was skipped).

    Args:
        run_dir: The run directory.

    Returns:
        Its events, sorted by time.

    Raises:
        FileNotFoundError: When there is no ledger.
    """
    return read_run(run_dir).events
