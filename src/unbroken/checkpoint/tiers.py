"""Where a Checkpointer's restore comes from: its arena's origin, and the memory tier's choice.

``adopt`` finds the arena a new Checkpointer starts with: the failed iteration's of this
process (an in-process restart), else the one the node agent's keeper held for this rank (a
launcher restart: the process that wrote it is dead), else, in a multi-node job, the newest
one any node's peer service holds for this rank (its keeper's, or the replica it was sent:
a lost node, ranks moved to other nodes), else none. ``from_memory`` restores the
newest step every rank holds in memory, checked, or says why not (then: disk); see ``memory``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint import keeper, layout, memory, peers
from unbroken.checkpoint.arena import Arena
from unbroken.checkpoint.config import CheckpointConfig
from unbroken.checkpoint.staging import Staging

logger = logging.getLogger(__name__)


def _key(root: Path, rank: int) -> str:
    return f"{root}#rank{rank}"


def adopt(root: Path, config: CheckpointConfig, *, rank: int) -> tuple[Arena | None, str | None]:
    """The arena to start with and where it came from: "process", "keeper", "peer" (fetched
    from another node's service: see ``peers``), or None."""
    if not config.memory_tier:
        return None, None
    arena = memory.take(root)
    if arena is not None:
        return arena, "process"
    fd = keeper.get(config.memory_keeper, _key(root, rank)) if config.memory_keeper else None
    if fd is not None:
        try:
            return Arena.adopt(fd), "keeper"
        except (OSError, ValueError) as e:
            logger.warning("the arena the memory keeper held is unusable: %s", e)
    if len(config.peers) < 2:
        return None, None
    arena, where = peers.fetch([peers.Peer.parse(p) for p in config.peers], _key(root, rank))
    if arena is None:
        return None, None
    logger.info("rank %d: snapshots fetched from the %s", rank, where)
    if config.memory_keeper:  # from now on this node keeps it
        hand_over(config.memory_keeper, root, rank, arena.fd)
    return arena, "peer"


def staging_for(
    root: Path, config: CheckpointConfig, *, rank: int
) -> tuple[Staging, str | None, peers.Replicator | None]:
    """A Checkpointer's staging (on the adopted arena, if any), where that arena came from,
    and, in a multi-node job, the replicator that sends each sealed snapshot to the next
    node's service."""
    arena, origin = adopt(root, config, rank=rank)
    replicator = None
    if config.memory_tier and len(config.peers) >= 2:
        buddy = config.peers[(config.peer_index + 1) % len(config.peers)]
        replicator = peers.Replicator(peers.Peer.parse(buddy), _key(root, rank))
    addr = config.memory_keeper
    staging = Staging(
        rank=rank,
        regions=config.regions,
        arena=arena,
        on_arena=functools.partial(hand_over, addr, root, rank) if addr else None,
        on_sealed=replicator.offer if replicator else None,
    )
    return staging, origin, replicator


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
    untrusted: bool = False,
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
            verdict = memory.verify(snaps[step], untrusted=untrusted) if verify else None
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
