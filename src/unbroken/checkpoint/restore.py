"""Find the newest sound checkpoint, check it, and load it into live objects (any world size).

With a process group, every rank takes part: rank 0 lists the committed checkpoints and
broadcasts the list, each rank checks its share of the files (file i on rank i mod world), and
the ranks agree on the verdict before loading, so all of them load the same step.
``torch.distributed.checkpoint.load`` then reads and reshards.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from unbroken.checkpoint import layout
from unbroken.checkpoint.config import CheckpointError
from unbroken.checkpoint.resolve import apply_loaded, template_for_load

logger = logging.getLogger(__name__)


@dataclass
class RestoreResult:
    """What ``restore`` found and did."""

    step: int | None
    """The step restored, or None when no sound checkpoint exists."""
    path: Path | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)
    """Committed checkpoints that failed their checks, newest first, with the reason."""
    skipped: list[str] = field(default_factory=list)
    """PerRank state keys the checkpoint had no value for on this rank (world size changed)."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _candidates(root: Path) -> list[int]:
    steps = []
    if not _distributed() or dist.get_rank() == 0:
        swept = layout.sweep_incomplete(root)
        if swept:
            logger.info("removed leftovers of interrupted saves: %s", swept)
        steps = layout.committed_steps(root)
    if _distributed():
        box: list[Any] = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    return steps


def _check(ckpt: Path, *, checksums: bool) -> str | None:
    """This rank's share of the checks, agreed across ranks: None if every rank found it sound."""
    if not _distributed():
        return layout.verify(ckpt, checksums=checksums)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        names = layout.manifest_files(ckpt)
        mine = names[rank::world]
        why = layout.verify(ckpt, files=mine, checksums=checksums)
    except (OSError, ValueError, KeyError) as e:
        why = f"unreadable manifest: {e}"
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, why)
    bad = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v]
    return "; ".join(bad) if bad else None


def restore(
    state: Mapping[str, Any], *, root: Path, rank: int, checksums: bool = True
) -> RestoreResult:
    """Load the newest committed checkpoint under ``root`` that passes its checks into
    ``state``; older ones are tried in turn. Collective when a process group exists.

    Also removes the leftovers of interrupted saves, so call it when no writer of this job is
    saving: at start, on every rank."""
    result = RestoreResult(step=None)
    for step in _candidates(root):
        ckpt = layout.step_dir(root, step)
        why = _check(ckpt, checksums=checksums)
        if why:
            logger.warning("checkpoint %s rejected: %s", ckpt, why)
            result.rejected.append((step, why))
            if not _distributed() or dist.get_rank() == 0:
                moved = layout.quarantine(ckpt)
                logger.warning("moved the rejected checkpoint to %s", moved)
            continue
        reader = FileSystemReader(ckpt)
        with layout.gc_paused():  # DCP's metadata of many ranks: see gc_paused
            saved_keys = set(reader.read_metadata().state_dict_metadata)
        plan = template_for_load(state, rank=rank, saved_keys=saved_keys)
        try:
            with warnings.catch_warnings(), layout.gc_paused():  # (dcp.load reads it again)
                # "assuming ... a single process": we know
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(plan.template, storage_reader=reader, no_dist=not _distributed())
        except Exception as e:
            # The bytes passed their checksums, so this is a mismatch with the live objects
            # (another model shape, missing keys), not corruption: falling back would load
            # older state into half-overwritten objects. Stop here.
            raise CheckpointError(
                f"checkpoint {ckpt} passed its checks but does not load into this state: "
                f"{type(e).__name__}: {e}"
            ) from e
        apply_loaded(state, plan, rank=rank)
        result.step, result.path, result.skipped = step, ckpt, plan.skipped
        if plan.skipped:
            logger.warning(
                "checkpoint %s has no per-rank state %s for rank %d (saved with another world "
                "size); left as is",
                ckpt,
                plan.skipped,
                rank,
            )
        return result
    return result
