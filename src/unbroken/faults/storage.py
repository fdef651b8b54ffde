"""Storage faults on a checkpoint directory: slow writes, corrupted bytes.

Faults import nothing else of ours, so the few on-disk names used here are written out; they
are the contract of ``unbroken.checkpoint.layout`` and ``unbroken.checkpoint.throttle`` (a unit
test checks that they agree):

- ``<root>/step-N/`` with a ``COMMITTED`` marker is a committed checkpoint; in it,
  ``__<rank>_0.distcp`` is a rank's data file and ``MANIFEST.json`` the manifest (CRC-32 of every
  file, itself checksummed by the marker);
- ``<root>/step-N.partial/`` is a save in flight, unless it holds an abandon marker
  (``.abandoned``, ``.rank-R.skipped``, ``.rank-R.failed``);
- ``<root>/.storage-faults/slow-<index>.json`` tells every checkpoint writer process, at the
  start of each save, to throttle its writes (the writer counts the saves it throttled).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

COMMITTED = "COMMITTED"
MANIFEST = "MANIFEST.json"
CONTROL_DIR = ".storage-faults"
_STEP_RE = re.compile(r"^step-(\d+)$")
_PARTIAL_RE = re.compile(r"^step-(\d+)\.partial$")
_FLIP_BYTES = 16
_POLL_S = 0.01


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- slow storage ----------------------------------------------------------------------------
def slow_control_path(root: Path, index: int) -> Path:
    return root / CONTROL_DIR / f"slow-{index}.json"


def write_slow_control(
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
    path = slow_control_path(root, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


# --- corruption ------------------------------------------------------------------------------
def newest_committed(root: Path) -> Path | None:
    """The committed checkpoint with the highest step under ``root``, or None."""
    best: tuple[int, Path] | None = None
    if not root.is_dir():
        return None
    for entry in os.scandir(root):
        m = _STEP_RE.match(entry.name)
        if m and os.path.exists(os.path.join(entry.path, COMMITTED)):
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, Path(entry.path))
    return None if best is None else best[1]


def saves_in_flight(root: Path) -> list[str]:
    """Partial checkpoint directories that no abandon marker ends: saves still being written."""
    out: list[str] = []
    if not root.is_dir():
        return out
    for entry in os.scandir(root):
        if not _PARTIAL_RE.match(entry.name):
            continue
        try:
            names = os.listdir(entry.path)
        except FileNotFoundError:  # committed (renamed) meanwhile
            continue
        if not any(n == ".abandoned" or n.endswith((".skipped", ".failed")) for n in names):
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
    ckpt = newest_committed(root)
    if ckpt is None:
        out.update(checkpoint=None, file=None, reason=f"no committed checkpoint under {root}")
        return out
    out["checkpoint"] = str(ckpt)
    path = ckpt / (data_file(rank) if target == "data" else MANIFEST)
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
