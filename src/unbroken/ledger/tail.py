"""Read a run's ledger while it is written: each ``poll()`` parses only the bytes appended since.

``read_run`` reads every file whole, which is right for a report after the fact and too slow for
a view refreshed every second over a long run. ``LedgerTail`` keeps, per ledger file, the offset
just past its last complete line. A poll stats the files, reads what was appended, parses the
complete lines and keeps an incomplete last line for the next poll (a writer may be in the
middle of it). At any moment ``events`` holds the records ``read_run`` would return (same
torn-line and bad-line rules; a last line is taken only once its newline is there), in file
order (``compute`` sorts).

A file that shrank or was replaced (not an append) resets the tail: everything is read again and
``generation`` changes, so a consumer knows to drop what it derived.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from unbroken.ledger.events import Event
from unbroken.ledger.reader import parse_line

logger = logging.getLogger(__name__)


@dataclass
class _File:
    offset: int = 0
    """Bytes consumed: just past the last complete line read."""
    lines: int = 0
    """Complete lines consumed (for bad-line positions)."""
    inode: int = 0
    pending: bool = False
    """Bytes past ``offset`` without a newline yet (a torn or still-written last line)."""


class LedgerTail:
    """The events of ``<run_dir>/events/*.jsonl``, kept up to date by ``poll()``."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.events_dir = self.run_dir / "events"
        self.events: list[Event] = []
        """Every complete, valid record read so far, in file order."""
        self.bad_lines: list[str] = []
        """Complete lines that did not parse, as ``file:line``."""
        self.generation = 0
        """Changes when the tail had to start over (a file shrank or was replaced)."""
        self.bytes_read = 0
        """Total bytes parsed (for cost figures)."""
        self._files: dict[str, _File] = {}

    @property
    def files(self) -> int:
        return len(self._files)

    @property
    def torn_lines(self) -> int:
        """Files whose last line is incomplete now (``read_run`` would count them as torn)."""
        return sum(1 for f in self._files.values() if f.pending)

    def exists(self) -> bool:
        return self.events_dir.is_dir()

    def _reset(self) -> None:
        self.events = []
        self.bad_lines = []
        self._files = {}
        self.generation += 1

    def poll(self) -> list[Event]:
        """Read what was appended since the last poll; returns the new records (maybe none).

        A run directory without ``events/`` (yet) is not an error: nothing is returned.
        """
        try:
            paths = sorted(self.events_dir.glob("*.jsonl"))
        except OSError:
            return []
        stats: dict[str, tuple[Path, os.stat_result]] = {}
        for path in paths:
            try:
                st = path.stat()
            except OSError:  # removed between glob and stat
                continue
            if stat.S_ISREG(st.st_mode):
                stats[path.name] = (path, st)
        for name, state in self._files.items():
            seen = stats.get(name)
            if seen is None or seen[1].st_ino != state.inode or seen[1].st_size < state.offset:
                logger.info("ledger file %s shrank or was replaced: reading the run again", name)
                self._reset()
                break
        new: list[Event] = []
        for name, (path, st) in stats.items():
            state = self._files.setdefault(name, _File(inode=st.st_ino))
            if st.st_size > state.offset:
                new.extend(self._read(path, state))
        self.events.extend(new)
        return new

    def _read(self, path: Path, state: _File) -> list[Event]:
        try:
            with open(path, "rb") as f:
                f.seek(state.offset)
                raw = f.read()
        except OSError as e:
            logger.warning("cannot read ledger file %s: %s", path, e)
            return []
        end = raw.rfind(b"\n") + 1  # 0 when no complete line arrived
        state.pending = end < len(raw)
        out: list[Event] = []
        for line in raw[:end].split(b"\n")[:-1]:
            state.lines += 1
            if not line.strip():
                continue
            try:
                out.append(parse_line(line))
            except ValueError:
                self.bad_lines.append(f"{path.name}:{state.lines}")
        state.offset += end
        self.bytes_read += end
        return out
