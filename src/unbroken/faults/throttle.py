"""Slow-storage faults: control files under the checkpoint root, and the writer hooks that
obey them.

A ``slow-storage`` fault writes ``<root>/.storage-faults/slow-<i>.json`` (fsynced) with
``ranks`` (None: every rank), ``bytes_per_s``, and either ``saves`` (how many of each rank's
saves it slows) or ``until`` (epoch seconds). A writer process that was handed ``SlowStorage``
as its hooks (``unbroken.checkpoint.persisting.hooks``; the fault injector provides them whenever its plan
holds a slow-storage fault) asks ``save_rate`` at the start of every save for its cap: the
lowest rate among the faults that apply to its rank and are not used up. The saves a fault has
slowed are counted per rank in ``slow-<i>.rank-<R>.used``, so a restarted writer (a new
in-process iteration, a relaunched worker) does not slow more saves than the plan says.

Retention and restore never touch this directory (its name matches no checkpoint pattern).
Nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from unbroken.checkpoint import layout
from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)

CONTROL_DIR = ".storage-faults"


def control_dir(root: Path) -> Path:
    return root / CONTROL_DIR


def write_control(
    root: Path,
    *,
    index: int,
    ranks: list[int] | None,
    bytes_per_s: float,
    saves: int | None,
    seconds: float | None,
) -> Path:
    """Durably write the control file of slow-storage fault ``index`` (ranks None: all)."""
    now = time.time()
    doc = {
        "index": index,
        "ranks": ranks,
        "bytes_per_s": bytes_per_s,
        "saves": saves,
        "until": None if seconds is None else now + seconds,
        "since": now,
    }
    path = control_dir(root) / f"slow-{index}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    layout.write_durable(path, json.dumps(doc).encode())
    return path


def used_path(control: Path, rank: int) -> Path:
    """Where the saves of ``rank`` that the fault of ``control`` acted on are counted."""
    return control.with_name(f"{control.stem}.rank-{rank}.used")


def read_used(path: Path) -> int:
    """The count in ``path`` (0: none yet, or unreadable)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def write_used(path: Path, used: int) -> None:
    """Replace the count in ``path`` atomically."""
    write_atomic(path, str(used))  # a restarted writer goes on counting from here


class SlowStorage:
    """Writer hooks (``unbroken.checkpoint.persisting.hooks.WriterHooks``): cap each save at the rate of
    the slow-storage faults in force under the writer's root. Holds no state (picklable)."""

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        try:
            return save_rate(root, rank=rank, now=time.time())
        except OSError as e:  # never fail a save over the fault's own files
            logger.warning("cannot read the slow-storage control files: %s", e)
            return None

    def at(self, point: str, *, root: Path, step: int) -> None:
        return None


def save_rate(root: Path, *, rank: int, now: float) -> float | None:
    """The write-rate cap (bytes/s) of a save that ``rank``'s writer starts ``now``, or None
    when no slow-storage fault applies; counts this save against each fault that applies."""
    directory = control_dir(root)
    if not directory.is_dir():
        return None
    rates = []
    for path in sorted(directory.glob("slow-*.json")):
        try:
            doc = json.loads(path.read_text())
            ranks, rate = doc["ranks"], float(doc["bytes_per_s"])
            saves, until = doc.get("saves"), doc.get("until")
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable slow-storage control file %s: %s", path, e)
            continue
        if ranks is not None and rank not in ranks:
            continue
        if until is not None and now >= float(until):
            continue
        if saves is not None:
            counter = used_path(path, rank)
            used = read_used(counter)
            if used >= int(saves):
                continue
            write_used(counter, used + 1)
        rates.append(rate)
    return min(rates) if rates else None
