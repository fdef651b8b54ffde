"""Find the newest sound checkpoint, check it, and load it into live objects (any world size).

With a process group, every rank takes part: rank 0 lists the committed checkpoints and
broadcasts the list, each rank checks its share of the files (file i on rank i mod world), and
the ranks agree on the verdict before loading, so all of them load the same step.
``torch.distributed.checkpoint.load`` then reads and reshards.

Before loading: a checkpoint another run wrote (its manifest's ``run``) is refused unless
``allow_foreign``; one whose tensors do not fit the live state (another model) is refused with
the mismatched names and shapes, before any live object is changed. An I/O error while
checking (EIO, ESTALE: the storage, not the checkpoint) is retried with a short backoff and
then raised as CheckpointError; the checkpoint is never quarantined for it.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from unbroken.checkpoint import layout
from unbroken.checkpoint.config import CheckpointConfig, CheckpointError
from unbroken.checkpoint.state import freshopt
from unbroken.checkpoint.state.resolve import apply_loaded, template_for_load
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)

IO_RETRY_BACKOFF_S = (0.05, 0.2, 0.5)
"""Waits between the attempts to check a checkpoint that hit an I/O error."""


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


def _verify_retrying(ckpt: Path, *, rank: int, world: int, checksums: bool) -> tuple[str, str]:
    """("ok" | "bad" | "io", why) of this rank's share of the checks, I/O errors retried."""
    for wait_s in (*IO_RETRY_BACKOFF_S, None):
        try:
            files = None
            if world > 1:
                try:
                    files = layout.manifest_files(ckpt)[rank::world]
                except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
                    return "bad", f"unreadable manifest: {e!r}"
            why = layout.verify(ckpt, files=files, checksums=checksums)
            return ("bad", why) if why else ("ok", "")
        except OSError as e:
            if wait_s is None:
                return "io", f"{type(e).__name__}: {e}"
            logger.warning("I/O error checking %s (%s); retrying in %.2f s", ckpt, e, wait_s)
            time.sleep(wait_s)
    raise AssertionError("unreachable")


def _check(ckpt: Path, *, checksums: bool) -> str | None:
    """This rank's share of the checks, agreed across ranks: None if every rank found it sound.
    Raises CheckpointError when a rank could not read it (an I/O error, retried)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    verdict = _verify_retrying(ckpt, rank=rank, world=world, checksums=checksums)
    verdicts: list[Any] = [verdict]
    if _distributed():
        verdicts = [None] * world
        dist.all_gather_object(verdicts, verdict)
    io = [f"rank {r}: {why}" for r, (kind, why) in enumerate(verdicts) if kind == "io"]
    if io:
        raise CheckpointError(
            f"could not read checkpoint {ckpt} after {len(IO_RETRY_BACKOFF_S) + 1} attempts "
            f"({'; '.join(io)}); it is left in place, not rejected. Check the storage, then "
            "restart the job"
        )
    bad = [
        f"rank {r}: {why}" if world > 1 else why
        for r, (k, why) in enumerate(verdicts)
        if k == "bad"
    ]
    return "; ".join(bad) if bad else None


def _check_owner(ckpt: Path, *, run: str | None, allow_foreign: bool) -> None:
    """Refuse a checkpoint another run wrote, unless ``allow_foreign``."""
    try:
        recorded, writer = layout.manifest_run(ckpt)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: unreadable manifest: {e}") from e
    if allow_foreign or run is None or not recorded or writer is None or writer == run:
        return
    raise CheckpointError(
        f"checkpoint {ckpt} was written by run {writer!r}, not by this run {run!r}. Restoring "
        "another run's checkpoint must be a choice: pass allow_foreign=True to the "
        "Checkpointer (the reference script: --resume), or use another checkpoint directory"
    )


def _check_shapes(template: Mapping[str, Any], saved: Mapping[str, Any], ckpt: Path) -> None:
    """Refuse a checkpoint whose tensors do not fit the live state, naming them."""
    flat, _ = flatten_state_dict(dict(template))
    wrong = []
    for key, value in sorted(flat.items()):
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved.get(key)
        if meta is None:
            wrong.append(f"{key}: absent from the checkpoint (this state: {list(value.shape)})")
        elif not isinstance(meta, TensorStorageMetadata):
            wrong.append(f"{key}: not a tensor in the checkpoint")
        elif list(meta.size) != list(value.shape):
            wrong.append(f"{key}: checkpoint {list(meta.size)}, this state {list(value.shape)}")
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit this state ({len(wrong)} tensors differ: {shown}). "
            "It was written for another model or configuration; restore it into the same "
            "model, or use another checkpoint directory. Nothing was loaded"
        )


def restore(
    state: Mapping[str, Any],
    *,
    root: Path,
    rank: int,
    checksums: bool = True,
    run: str | None = None,
    allow_foreign: bool = False,
) -> RestoreResult:
    """Load the newest committed checkpoint under ``root`` that passes its checks into
    ``state``; older ones are tried in turn. Collective when a process group exists.
    ``run``: this run's identity, checked against the manifest's (None: not checked).

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
                try:
                    moved = layout.quarantine(ckpt)
                    logger.warning("moved the rejected checkpoint to %s", moved)
                except OSError as e:  # a read-only disk: leave it, try the older ones
                    logger.warning("could not move the rejected checkpoint %s aside: %s", ckpt, e)
            continue
        _check_owner(ckpt, run=run, allow_foreign=allow_foreign)
        reader = FileSystemReader(ckpt)
        with layout.gc_paused():  # DCP's metadata of many ranks: see gc_paused
            saved = reader.read_metadata().state_dict_metadata
        held = freshopt.Saved(
            tensors={
                k: (m.properties.dtype, tuple(m.size))
                for k, m in saved.items()
                if isinstance(m, TensorStorageMetadata)
            },
            values=tuple(k for k, m in saved.items() if not isinstance(m, TensorStorageMetadata)),
            local=False,
        )
        plan = template_for_load(state, rank=rank, saved_keys=set(saved), saved=held)
        _check_shapes(plan.template, saved, ckpt)
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


def restore_recorded(
    state: Mapping[str, Any],
    *,
    root: Path,
    rank: int,
    config: CheckpointConfig,
    run: str | None,
    ledger: Recorder,
    begin: float,
    memory: list[Any],
    why: str | None,
) -> int | None:
    """``restore`` from disk (after the memory tier had nothing: ``memory`` and ``why`` say
    what it held), recorded in ``ledger``: every rejected checkpoint, then the load."""
    result = restore(
        state,
        root=root,
        rank=rank,
        checksums=config.verify,
        run=run,
        allow_foreign=config.allow_foreign,
    )
    for step, reason in result.rejected:
        ledger.emit(ev.CKPT_FAIL, step=step, error=f"rejected at restore: {reason}", phase="load")
    ledger.interval(
        ev.CKPT_LOAD,
        begin=begin,
        step=result.step,
        tier="disk" if result.step is not None else "none",
        path=str(result.path) if result.path else None,
        rejected=[s for s, _ in result.rejected],
        skipped=result.skipped,
        memory=memory,
        why=why,
    )
    ledger.mark()
    return result.step
