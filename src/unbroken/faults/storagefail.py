"""Storage-fail faults: control files under the checkpoint root, and the writer hooks that fail
saves the way failing storage fails them.

A ``storage-fail`` fault writes ``<root>/.storage-faults/fail-<i>.json`` (fsynced; next to the
slow-storage ones, ``throttle``) with ``ranks`` (None: every rank), ``error`` (a key of
``ERRORS``), ``saves`` and ``stall_s``. A writer process that was handed ``FailingStorage`` as
its hooks (``unbroken.checkpoint.persisting.hooks``; the fault injector provides them whenever
its plan holds a storage-fail fault) raises the fault's ``OSError`` from a hook, which fails
that save as the same error from the file system would: the Checkpointer records it
(``ckpt_fail``, with the message) and the previous committed checkpoint stays the newest.

Where a save fails depends on the error, as on real storage: ``readonly`` and ``flock`` as it
starts (``save_rate``: opening fails), ``full``, ``eio``, ``vanish`` and ``stall`` at its
``data`` point (half of the rank's tensors written, a partial file to give back). ``stall``
blocks there for ``stall_s`` (default ``params.STALL_S``, beyond any ``persist_timeout_s``, so
that the Checkpointer kills the writer); should it wake first, the save fails with ETIMEDOUT.

Each fault fails ``saves`` saves of each rank it applies to: a save it fails is counted in
``fail-<i>.rank-<R>.used`` (before a stall blocks), so a restarted writer (a new in-process
iteration, a relaunched worker) fails no more saves than the plan says. A save that holds no
tensor of the rank reaches no ``data`` point: the write errors wait for the next one.

Emulated: the error is raised at the writer's I/O boundary, not by a file system (its
``strerror`` is the real one, followed by ``(injected by the fault plan: storage-fail
<error>)``). ``tests/unit/test_checkpoint_storage_faults.py`` fills a real tmpfs and remounts
one read-only. Nothing here imports torch.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from unbroken.checkpoint import layout
from unbroken.faults import throttle
from unbroken.faults.params import STALL_S, STORAGE_ERRORS

logger = logging.getLogger(__name__)

START, DATA = "start", "data"

ERRORS: dict[str, tuple[int, str]] = {
    "full": (errno.ENOSPC, DATA),
    "readonly": (errno.EROFS, START),
    "eio": (errno.EIO, DATA),
    "vanish": (errno.ENOENT, DATA),
    "flock": (errno.ENOLCK, START),
    "stall": (errno.ETIMEDOUT, DATA),
}
"""error -> (the errno raised, where in the save: START or DATA)."""

assert tuple(ERRORS) == STORAGE_ERRORS, "ERRORS covers every storage-fail error, in order"


def write_control(
    root: Path,
    *,
    index: int,
    ranks: list[int] | None,
    error: str,
    saves: int,
    stall_s: float | None,
) -> Path:
    """Durably write the control file of storage-fail fault ``index`` (ranks None: all)."""
    doc = {
        "index": index,
        "ranks": ranks,
        "error": error,
        "saves": saves,
        "stall_s": stall_s,
        "since": time.time(),
    }
    path = throttle.control_dir(root) / f"fail-{index}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    layout.write_durable(path, json.dumps(doc).encode())
    return path


class FailingStorage:
    """Writer hooks (``unbroken.checkpoint.persisting.hooks.WriterHooks``): fail the saves the
    storage-fail faults under the writer's root say. Keeps only its writer's rank, told by
    ``save_rate`` at the start of each save (picklable)."""

    def __init__(self) -> None:
        self.rank: int | None = None

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        self.rank = rank
        fail(root, rank=rank, step=step, where=START)
        return None

    def at(self, point: str, *, root: Path, step: int) -> None:
        if point == DATA and self.rank is not None:
            fail(root, rank=self.rank, step=step, where=DATA)


class Combined:
    """Writer hooks that apply several in order (a plan with slow-storage and storage-fail
    faults): the lowest cap wins, and the first hook that raises fails the save (the later
    ones are not asked, so a save failed at its start counts against no slow-storage fault).
    """

    def __init__(self, *hooks: FailingStorage | throttle.SlowStorage) -> None:
        self.hooks = hooks

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        rates = [h.save_rate(root=root, rank=rank, step=step) for h in self.hooks]
        caps = [r for r in rates if r is not None]
        return min(caps) if caps else None

    def at(self, point: str, *, root: Path, step: int) -> None:
        for h in self.hooks:
            h.at(point, root=root, step=step)


def fail(root: Path, *, rank: int, step: int, where: str) -> None:
    """Raise the error of the first storage-fail fault under ``root`` that fails this save of
    ``rank`` at ``where`` (START or DATA) and is not used up, counting it; else return.

    Raises:
        OSError: The fault's error (after ``stall_s`` for a stall), naming the fault.
    """
    doc = _due(root, rank=rank, where=where)
    if doc is None:
        return
    error = doc["error"]
    code = ERRORS[error][0]
    part = layout.partial_dir(root, step)
    filename = part if error == "vanish" else part / layout.data_file(rank)
    logger.warning(
        "rank %d: failing the save of step %d: storage-fail %s (fault #%s)",
        rank,
        step,
        error,
        doc.get("index"),
    )
    why = f"injected by the fault plan: storage-fail {error}"
    if error == "stall":
        stall_s = float(doc.get("stall_s") or STALL_S)
        time.sleep(stall_s)  # the write makes no progress
        why += f", no progress for {stall_s:g} s"
    raise OSError(code, f"{os.strerror(code)} ({why})", str(filename))


def _due(root: Path, *, rank: int, where: str) -> dict[str, Any] | None:
    """The control file of the fault that fails this save (counted against it), or None."""
    directory = throttle.control_dir(root)
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("fail-*.json")):
        try:
            doc = json.loads(path.read_text())
            ranks, error, saves = doc["ranks"], str(doc["error"]), int(doc["saves"])
            if error not in ERRORS:
                raise ValueError(f"unknown error {error!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable storage-fail control file %s: %s", path, e)
            continue
        if ERRORS[error][1] != where or (ranks is not None and rank not in ranks):
            continue
        counter = throttle.used_path(path, rank)
        used = throttle.read_used(counter)
        if used >= saves:
            continue
        try:
            throttle.write_used(counter, used + 1)
        except OSError as e:  # never fail a save over the fault's own files
            logger.warning("cannot count a storage-fail save in %s: %s", counter, e)
            continue
        return dict(doc)
    return None
