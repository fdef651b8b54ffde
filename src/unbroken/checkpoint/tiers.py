"""Where a Checkpointer's restore comes from: its arena's origin, and the memory tier's choice.

``adopt`` finds the arena a new Checkpointer starts with: the failed iteration's of this
process (an in-process restart), else the one the node agent's keeper held for this rank (a
launcher restart: the process that wrote it is dead), else none. ``from_memory`` restores the
newest step every rank holds in memory, checked, or says why not (then: disk); see ``memory``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint import keeper, layout, memory
from unbroken.checkpoint.arena import Arena
from unbroken.checkpoint.config import CheckpointConfig
from unbroken.checkpoint.staging import Staging

logger = logging.getLogger(__name__)


def _key(root: Path, rank: int) -> str:
    return f"{root}#rank{rank}"


def adopt(root: Path, config: CheckpointConfig, *, rank: int) -> tuple[Arena | None, str | None]:
    """The arena to start with and where it came from: "process", "keeper", or None."""
    if not config.memory_tier:
        return None, None
    arena = memory.take(root)
    if arena is not None:
        return arena, "process"
    if not config.memory_keeper:
        return None, None
    fd = keeper.get(config.memory_keeper, _key(root, rank))
    if fd is None:
        return None, None
    try:
        return Arena.adopt(fd), "keeper"
    except (OSError, ValueError) as e:
        logger.warning("the arena the memory keeper held is unusable: %s", e)
        return None, None


def hand_over(addr: str, root: Path, rank: int, fd: int) -> None:
    """Give a newly allocated arena to the keeper at ``addr`` (it outlives this process)."""
    keeper.put(addr, _key(root, rank), fd)


def _gather(mine: Any, world_size: int) -> list[Any]:
    if dist.is_available() and dist.is_initialized():
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, mine)
        return out
    return [mine]


def from_memory(
    state: Mapping[str, Any],
    arena: Arena | None,
    *,
    staging: Staging,
    root: Path,
    rank: int,
    world_size: int,
    verify: bool,
    timings: dict[str, float],
) -> tuple[int | None, list[Any], str | None]:
    """Restore the newest step every rank holds in memory into ``state``: the step (None:
    restore from disk), the steps each rank held, and why memory was or was not used; adds
    the seconds of each part to ``timings`` (``gather_s``: agreeing with the other ranks,
    ``prepare_s``: matching the live state, a fresh optimizer's state made by ``freshopt``;
    ``verify_s``: the digests; ``copy_s``: the copy into the state, in a fresh process mostly
    faulting in the new optimizer state's pages). With
    ``verify`` (an arena a dead process wrote) each copy's digests are checked first; a step
    that fails on any rank is passed over for the next older one every rank holds.
    Collective with a process group: one all-gather of the held steps, then one of the
    verdicts per step tried (the same count on every rank)."""
    snaps: dict[int, memory.Snapshot] = {}
    if arena is not None:
        _, found = memory.read(arena)
        for snap in found:
            if (snap.rank, snap.world_size) == (rank, world_size):
                snaps.setdefault(snap.step, snap)
    t0 = time.perf_counter()
    held = _gather(sorted(snaps, reverse=True), world_size)
    timings["gather_s"] = time.perf_counter() - t0
    common = set(held[0]).intersection(*held[1:])
    if not common:
        return None, held, "nothing in memory" if not any(held) else "no step every rank holds"
    reasons = []
    for step in sorted(common, reverse=True):
        pending, verdict = None, None
        t1 = time.perf_counter()
        try:
            pending = memory.prepare(state, snaps[step], rank=rank)
            t2 = time.perf_counter()
            timings["prepare_s"] = timings.get("prepare_s", 0.0) + t2 - t1
            verdict = memory.verify(snaps[step]) if verify else None
            timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - t2
        except memory.Mismatch as e:
            verdict = f"step {step} does not fit: {e}"
        t3 = time.perf_counter()
        bad = [f"rank {r}: {v}" for r, v in enumerate(_gather(verdict, world_size)) if v]
        timings["gather_s"] += time.perf_counter() - t3
        if bad:
            logger.warning("in-memory snapshot of step %d not used: %s", step, bad)
            reasons.append("; ".join(bad))
            continue
        assert pending is not None
        t4 = time.perf_counter()
        pending.apply()
        timings["copy_s"] = time.perf_counter() - t4
        staging.retain(snaps[step].region)
        if rank == 0:  # what the killed writers left, as a disk restore does
            layout.sweep_incomplete(root)
        why = "the newest step every rank holds" + (", checksums verified" if verify else "")
        if reasons:
            why += f" (newer ones rejected: {' | '.join(reasons)})"
        return step, held, why
    return None, held, " | ".join(reasons)
