"""Where a Checkpointer's restore comes from: its arena's origin, and the memory tier's choice.

``adopt`` finds the arena a new Checkpointer starts with: the failed iteration's of this
process (an in-process restart), else the one the node agent's keeper held for this rank (a
launcher restart: the process that wrote it is dead), else, in a multi-node job, the newest
one any node's peer service holds for this rank (its keeper's, or the replica it was sent:
a lost node, ranks moved to other nodes), else none. ``from_memory`` restores the
newest step every rank holds in memory, checked, or says why not (then: disk); see ``memory``.

An arena adopted from the keeper is warmed on a thread (``Warm``) while the new process goes
on (in ``unbroken.workload`` it builds its model meanwhile): its snapshots' digests are
checked (which also maps the arena's pages), and a ``freshopt.Pool`` the size of one
snapshot's optimizer state is faulted in and filled with that state, for ``from_memory`` to carve
the fresh optimizer state from (its copy then skips what is there already). The snapshot is
the newest one that the node's other ranks hold too (their arenas' headers, from the keeper):
the step the restore's all-gather will most likely agree on. ``from_memory``
waits for what is left of it (in ``prepare_s``). What moved: the page faults of the fresh
optimizer state, its copy and the digests, from the restore to the time the new process
builds its model (with a Checkpointer made first, as ``unbroken.workload`` does); with
one made just before the restore, the restore waits for all of it, as long as before. A verdict holds for the
region's snapshot as sealed then (its step and sequence number, checked again at the restore):
the process that wrote the arena is dead and this one stages nothing before it restores.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint import layout
from unbroken.checkpoint.config import CheckpointConfig
from unbroken.checkpoint.staging import journal, memory, ring_format
from unbroken.checkpoint.staging.arena import Arena
from unbroken.checkpoint.staging.staging import Staging
from unbroken.checkpoint.state import freshopt
from unbroken.checkpoint.tiers import catchup, keeper, peers
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)


def _key(root: Path, rank: int) -> str:
    return f"{root}#rank{rank}"  # the keeper's key (``_held_nearby`` lists them by prefix)


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
            arena = Arena.adopt(fd)
        except (OSError, ValueError) as e:
            logger.warning("the arena the memory keeper held is unusable: %s", e)
        else:
            others = functools.partial(_held_nearby, config.memory_keeper, root, rank)
            _warming[arena] = Warm(arena, rank, others)
            return arena, "keeper"
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
    root: Path, config: CheckpointConfig, *, rank: int, world_size: int
) -> tuple[Staging, str | None, peers.Replicator | None]:
    """A Checkpointer's staging (on the adopted arena, if any; with the journal the keeper
    holds, when it has peers: ``journal``), where that arena came from, and, in a multi-node
    job, the replicator that sends each sealed snapshot to the next node's service."""
    arena, origin = adopt(root, config, rank=rank)
    replicator = None
    if config.memory_tier and len(config.peers) >= 2:
        buddy = config.peers[(config.peer_index + 1) % len(config.peers)]
        replicator = peers.Replicator(peers.Peer.parse(buddy), _key(root, rank))
    addr = config.memory_keeper if config.memory_tier else ""  # nothing to restore else
    staging = Staging(
        rank=rank,
        regions=config.regions,
        lean=config.lean,
        arena=arena,
        on_arena=functools.partial(hand_over, addr, root, rank) if addr else None,
        on_sealed=replicator.offer if replicator else None,
    )
    if addr and config.rescue and world_size > 1:  # the catch-up's, which needs peers
        staging.journaled, staging.journal = _journal(addr, root, rank)
    return staging, origin, replicator


def _journal(addr: str, root: Path, rank: int) -> tuple[journal.Entry | None, journal.Journal]:
    """What the last process of this rank journaled (None: nothing), and a new journal the
    keeper holds from now on."""
    key = f"{root}#journal{rank}"
    entry = None
    fd = keeper.get(addr, key)
    if fd is not None:
        try:
            entry = journal.read(fd)
        finally:
            os.close(fd)
    new = journal.Journal()
    keeper.put(addr, key, new.fd)
    return entry, new


def _held_nearby(addr: str, root: Path, rank: int) -> list[set[int]]:
    """The steps sealed in each arena the node's keeper holds for the other ranks of ``root``
    (a hint for ``Warm``: their headers only, nothing checked)."""
    out = []
    for key in keeper.keys(addr, f"{root}#rank"):
        if key == _key(root, rank):
            continue
        fd = keeper.get(addr, key)
        if fd is None:
            continue
        try:
            arena = Arena.adopt(fd, name="unbroken-peek")
        except (OSError, ValueError):
            continue  # unusable: that rank's own restore says why
        try:
            ring = ring_format.read_ring(arena)
            sealed = (
                [ring_format.sealed_as(arena, ring, r) for r in range(ring.regions)] if ring else []
            )
            out.append({s[0] for s in sealed if s is not None})
        finally:
            arena.close()
    return out


class Warm:
    """The warming of an adopted arena (see the module docstring), on a thread of its own."""

    def __init__(
        self, arena: Arena, rank: int, others: Callable[[], list[set[int]]] = list
    ) -> None:
        self.verdicts: dict[tuple[int, int, int], str | None] = {}
        """(region, step, sequence number) -> ``memory.verify``'s verdict."""
        self.pool: freshopt.Pool | None = None
        self.target: int | None = None
        """The step whose optimizer state the pool holds (filled for)."""
        self.loaded: dict[str, tuple[bytes, Any]] = {}
        """That step's non-tensor values, loaded ahead: fqn -> (bytes, value)."""
        self._thread = threading.Thread(
            target=self._run, args=(arena, rank, others), name="unbroken-warm", daemon=True
        )
        self._thread.start()

    def _run(self, arena: Arena, rank: int, others: Callable[[], list[set[int]]]) -> None:
        try:
            _, found = memory.read(arena)
            mine = [s for s in found if s.rank == rank]
            if not mine:
                return
            # The snapshot the restore will most likely agree on: the newest that this node's
            # other ranks hold too (one that outlived the rank that died may be a step ahead).
            held = others()
            target = next((s for s in mine if all(s.step in h for h in held)), mine[0])
            self.target = target.step
            saved = {i.fqn: (s.dtype, s.shape) for i, s in target.tensors}
            size = freshopt.spare_bytes(freshopt.Saved(tensors=saved, values=()))
            if size:
                pool = freshopt.Pool(size)
                pool.fault_in()
                self.pool = pool
            for snap in mine:
                self.verdicts[_id(snap)] = memory.verify(snap)
            if self.pool is not None and self.verdicts[_id(target)] is None:
                # Its optimizer state, where its fresh state will be carved.
                self.pool.fill(
                    [
                        ((_id(target), slot), target.arena.view(slot))
                        for i, slot in target.tensors
                        if slot.shape and f".{freshopt.STATE}." in i.fqn
                    ]
                )
            if self.verdicts[_id(target)] is None:
                self.loaded = {
                    i.fqn: (data, memory.load_value(data)) for i, data in target.payloads
                }
        except Exception as e:  # noqa: BLE001 - only a slower restore: it checks again
            logger.warning("warming the adopted arena failed: %s", e)

    def wait(self) -> None:
        self._thread.join()

    def verdict(
        self, snap: memory.Snapshot, ring: ring_format.Ring | None
    ) -> tuple[bool, str | None]:
        """(known, verdict) for ``snap``: known when it was checked here and its region
        still holds the same sealed snapshot."""
        key = _id(snap)
        if key not in self.verdicts or ring is None:
            return False, None
        if ring_format.sealed_as(snap.arena, ring, snap.region) != (snap.step, snap.seq):
            return False, None
        return True, self.verdicts[key]


def _filled(pool: freshopt.Pool, snap_id: tuple[int, int, int], dst: Any, slot: Any) -> bool:
    """Whether ``Warm`` copied ``slot`` of that snapshot where ``dst`` was carved."""
    return bool(pool.tag_of(dst) == (snap_id, slot))


def _id(snap: memory.Snapshot) -> tuple[int, int, int]:
    return (snap.region, snap.step, snap.seq)


_warming: weakref.WeakKeyDictionary[Arena, Warm] = weakref.WeakKeyDictionary()


def hand_over(addr: str, root: Path, rank: int, fd: int) -> None:
    """Give a newly allocated arena to the keeper at ``addr`` (it outlives this process)."""
    keeper.put(addr, _key(root, rank), fd)


def _gather(mine: Any, world_size: int) -> list[Any]:
    if world_size > 1 and dist.is_available() and dist.is_initialized():  # a group of one: mine
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, mine)
        return out
    return [mine]


def restore_recorded(
    state: Mapping[str, Any],
    arena: Arena | None,
    *,
    staging: Staging,
    root: Path,
    rank: int,
    world_size: int,
    source: str | None,
    ledger: Recorder,
    begin: float,
) -> tuple[int | None, list[Any], str | None]:
    """``from_memory`` with the checks ``source`` calls for (an arena another process or a
    peer wrote is verified; a peer's is untrusted), recorded as a ``ckpt_load`` interval from
    ``begin`` (tier "memory" or "peer") when memory held the step; same return value."""
    timings: dict[str, Any] = {}  # seconds
    step, held, why = from_memory(
        state,
        arena,
        staging=staging,
        root=root,
        rank=rank,
        world_size=world_size,
        verify=source != "process",
        timings=timings,
        untrusted=source == "peer",
    )
    if step is not None:
        ledger.interval(
            ev.CKPT_LOAD,
            begin=begin,
            step=step,
            tier="peer" if source == "peer" else "memory",
            path=None,
            source=source,
            memory=held,
            why=why,
            **timings,
        )
        ledger.mark()
    return step, held, why


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
    ``prepare_s``: waiting for what is left of the ``Warm``-up, then matching the live state,
    a fresh optimizer's state made by ``freshopt``; ``verify_s``: the digests not checked by
    the warm-up; ``copy_s``: the copy into the state) and ``pooled``, the state tensors
    carved from the warmed pool. With
    ``verify`` (an arena a dead process wrote) each copy's digests are checked first; a step
    that fails on any rank is passed over for the next older one every rank holds.
    Collective with a process group: one all-gather of the held steps, then one of the
    verdicts per step tried (the same count on every rank)."""
    warm = _warming.pop(arena, None) if arena is not None else None
    t0 = time.perf_counter()
    if warm is not None:
        warm.wait()  # what is left of it
    timings["prepare_s"] = time.perf_counter() - t0
    pool = warm.pool if warm is not None else None
    try:
        with freshopt.carving(pool):
            return _newest(
                state, arena, staging, root, rank, world_size, verify, timings, untrusted, warm
            )
    finally:
        if pool is not None:
            timings["pooled"] = pool.carved
            pool.close()


def _newest(
    state: Mapping[str, Any],
    arena: Arena | None,
    staging: Staging,
    root: Path,
    rank: int,
    world_size: int,
    verify: bool,
    timings: dict[str, float],
    untrusted: bool,
    warm: Warm | None,
) -> tuple[int | None, list[Any], str | None]:
    snaps: dict[int, memory.Snapshot] = {}
    ring = None
    if arena is not None:
        ring, found = memory.read(arena)
        for snap in found:
            if (snap.rank, snap.world_size) == (rank, world_size):
                snaps.setdefault(snap.step, snap)
    # Before the all-gather (a rank that comes first does it while it waits for the others):
    # the step this rank expects to restore (the warm-up's, else its newest), matched with the
    # live state, and every verdict known without reading the bytes. When every rank expects
    # the step they agree on and knows its verdict, that one gather decides.
    t1 = time.perf_counter()
    guess = warm.target if warm is not None and warm.target in snaps else max(snaps, default=None)
    ready: memory.Pending | None = None
    known: dict[int, str | None] = {}
    if guess is not None:
        try:
            ready = memory.prepare(state, snaps[guess], rank=rank)
        except memory.Mismatch:
            guess = None  # the round below says why
        for step, snap in snaps.items():
            if not verify:
                known[step] = None
            elif warm is not None and not untrusted:
                is_known, verdict = warm.verdict(snap, ring)
                if is_known:
                    known[step] = verdict
    timings["prepare_s"] += time.perf_counter() - t1
    t0 = time.perf_counter()
    gathered = _gather((sorted(snaps, reverse=True), guess, known), world_size)
    timings["gather_s"] = time.perf_counter() - t0
    held = [g[0] for g in gathered]
    common = set(held[0]).intersection(*held[1:])
    if not common:
        return None, held, "nothing in memory" if not any(held) else "no step every rank holds"
    reasons = []
    for step in sorted(common, reverse=True):
        if all(g[1] == step and step in g[2] for g in gathered):  # decided by the one gather
            pending: memory.Pending | None = ready
            bad = [f"rank {r}: {g[2][step]}" for r, g in enumerate(gathered) if g[2][step]]
            known_here = True
        else:
            pending, bad, known_here = _agree(
                state, snaps[step], rank, world_size, verify, timings, untrusted, warm, ring,
                ready if step == guess else None,
            )  # fmt: skip
        if bad:
            logger.warning("in-memory snapshot of step %d not used: %s", step, bad)
            reasons.append("; ".join(bad))
            continue
        assert pending is not None
        t4 = time.perf_counter()
        loaded = warm.loaded if warm is not None and warm.target == step else None
        if known_here and warm is not None and warm.pool is not None:  # copied ahead?
            pending.apply(
                done=functools.partial(_filled, warm.pool, _id(snaps[step])), loaded=loaded
            )
        else:
            pending.apply(loaded=loaded)
        timings["copy_s"] = time.perf_counter() - t4
        why = "the newest step every rank holds" + (", checksums verified" if verify else "")
        if reasons:
            why += f" (newer ones rejected: {' | '.join(reasons)})"
        caught = None
        if world_size > 1:  # before ``retain`` forgets the newer steps
            t5 = time.perf_counter()
            caught = catchup.catch_up(
                state, arena, step, rank=rank, world_size=world_size,
                entry=staging.journaled, verify=verify, untrusted=untrusted,
            )  # fmt: skip
            timings["catch_up_s"] = time.perf_counter() - t5
        staging.retain(snaps[step].region)  # the step every rank holds, also after a catch-up
        if rank == 0:  # what the killed writers left, as a disk restore does
            layout.sweep_incomplete(root)
        return (step, held, why) if caught is None else (caught[0], held, caught[1])
    return None, held, " | ".join(reasons)


def _agree(
    state: Mapping[str, Any],
    snap: memory.Snapshot,
    rank: int,
    world_size: int,
    verify: bool,
    timings: dict[str, float],
    untrusted: bool,
    warm: Warm | None,
    ring: ring_format.Ring | None,
    ready: memory.Pending | None,
) -> tuple[memory.Pending | None, list[str], bool]:
    """One more round for ``snap``'s step: match it with the live state (unless ``ready``),
    check its digests where needed, and gather every rank's verdict; returns the match, the
    ranks' complaints (none: use it) and whether this rank's verdict came from the warm-up."""
    pending, verdict, known = ready, None, False
    t1 = time.perf_counter()
    try:
        if pending is None:
            pending = memory.prepare(state, snap, rank=rank)
        t2 = time.perf_counter()
        timings["prepare_s"] += t2 - t1
        if warm is not None and not untrusted:  # checked by the warm-up already?
            known, verdict = warm.verdict(snap, ring)
        if verify and not known:
            verdict = memory.verify(snap, untrusted=untrusted)
        timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - t2
    except memory.Mismatch as e:
        verdict = f"step {snap.step} does not fit: {e}"
    t3 = time.perf_counter()
    bad = [f"rank {r}: {v}" for r, v in enumerate(_gather(verdict, world_size)) if v]
    timings["gather_s"] += time.perf_counter() - t3
    return pending, bad, known
