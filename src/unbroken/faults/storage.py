"""Checkpoint corruption: flipped bytes in the newest committed checkpoint.

The checkpoint's on-disk names come from ``unbroken.checkpoint.layout`` (which imports no
torch); the slow-storage fault lives in ``throttle``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from unbroken.checkpoint import layout

_FLIP_BYTES = 16
_POLL_S = 0.01
_ENDING_MARKERS = (layout.ABANDONED, ".skipped", ".failed")


def saves_in_flight(root: Path) -> list[str]:
    """Saves still being written or committed: partial checkpoint directories that no abandon
    marker ends, and checkpoints renamed into place whose ``COMMITTED`` is not written yet."""
    out: list[str] = []
    if not root.is_dir():
        return out
    for entry in os.scandir(root):
        partial = entry.name.endswith(layout.PARTIAL_SUFFIX)
        if not partial and not layout.is_step_name(entry.name):
            continue
        try:
            names = os.listdir(entry.path)
        except FileNotFoundError:  # committed (renamed) or removed meanwhile
            continue
        # (a step-N without COMMITTED that no commit finishes, a crash's leftover, is swept
        # at the restore)
        ended = (
            any(n.endswith(_ENDING_MARKERS) for n in names)
            if partial
            else layout.COMMITTED in names
        )
        if not ended:
            out.append(entry.name)
    return sorted(out)


def corrupt_newest(root: Path, *, rank: int, target: str, settle_s: float) -> dict[str, Any]:
    """Flip bytes in the middle of the newest committed checkpoint's ``target`` file ("data":
    this rank's data file; "manifest") and fsync it. Saves in flight get up to ``settle_s``
    to commit first, so the checkpoint corrupted is the one a restore would pick.

    Returns what was done, for the ledger: ``checkpoint`` and ``file`` (None, with ``reason``,
    when there was nothing to corrupt), ``offset`` and ``bytes`` flipped, ``waited_s``."""
    t0 = time.monotonic()
    while saves_in_flight(root) and time.monotonic() - t0 < settle_s:
        time.sleep(_POLL_S)
    out: dict[str, Any] = {"target": target, "waited_s": round(time.monotonic() - t0, 3)}
    pending = saves_in_flight(root)
    if pending:
        out["in_flight"] = pending
    steps = layout.committed_steps(root)
    if not steps:
        out.update(checkpoint=None, file=None, reason=f"no committed checkpoint under {root}")
        return out
    ckpt = layout.step_dir(root, steps[0])
    out["checkpoint"] = str(ckpt)
    path = ckpt / (layout.data_file(rank) if target == "data" else layout.MANIFEST)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        out.update(file=None, reason=f"cannot open {path}: {e.strerror}")
        return out
    try:
        size = os.fstat(fd).st_size
        n = min(_FLIP_BYTES, size)
        offset = max(0, size // 2 - n // 2)
        data = os.pread(fd, n, offset)
        os.pwrite(fd, bytes(b ^ 0xFF for b in data), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    out.update(file=str(path), offset=offset, bytes=n)
    if n == 0:
        out["reason"] = f"{path} is empty: nothing to flip"
    return out
