"""The memory tier's parts on their own: the ring of snapshot regions in an arena (sealed last,
cleared first, checked by digest), the region a save goes to, and the agent's memory keeper
handing an arena from one process to the next."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from toy import mlp, train_step
from unbroken.checkpoint import CheckpointConfig, Checkpointer, layout
from unbroken.checkpoint.staging import memory, ring_format
from unbroken.checkpoint.staging.arena import Arena, Slot, copy_into, plan_slots
from unbroken.checkpoint.staging.staging import Staging
from unbroken.checkpoint.tiers import keeper, tiers
from unbroken.launcher.keeper import MemoryKeeper
from unbroken.ledger import Ledger, read_events


def _ring_with(
    steps: list[int], *, fqn: str = "w", rank: int = 0, world_size: int = 1
) -> tuple[Arena, ring_format.Ring, list[memory.Snapshot]]:
    """An arena of three regions holding ``steps`` (one tensor each: a ramp of step + i)."""
    slots, total = plan_slots([(torch.float32, (256,), 1024)])
    ring = ring_format.Ring.sized(3, total, 0, None)
    arena = Arena()
    arena.ensure(ring.total)
    ring_format.write_ring(arena, ring)
    snaps = []
    for region, step in enumerate(steps):
        base = ring.data_base(region)
        slot = Slot(base + slots[0].offset, 1024, torch.float32, (256,))
        copy_into(arena, [(torch.arange(256, dtype=torch.float32) + step, slot)])
        snap = memory.Snapshot(
            step=step, rank=rank, world_size=world_size, arena=arena, region=region,
            tensors=[(MetadataIndex(fqn), slot)], payloads=[(MetadataIndex("p"), b"x")],
            digests=[], seq=region + 1,
        )  # fmt: skip
        memory.seal(snap, ring)
        snaps.append(snap)
    return arena, ring, snaps


def test_sealed_regions_read_back_newest_first_and_verify() -> None:
    arena, ring, _ = _ring_with([4, 5, 6])
    got_ring, held = memory.read(arena)
    assert got_ring == ring
    assert [s.step for s in held] == [6, 5, 4]
    assert all(memory.verify(s) is None for s in held)
    assert torch.equal(arena.view(held[0].tensors[0][1]), torch.arange(256.0) + 6)
    assert held[0].payloads == [(MetadataIndex("p"), b"x")]
    arena.close()


def test_a_flipped_byte_fails_the_check_and_a_cleared_region_is_gone() -> None:
    arena, ring, snaps = _ring_with([4, 5, 6])
    slot = snaps[1].tensors[0][1]
    byte = arena.read(slot.offset + 7, 1)[0]
    arena.write(slot.offset + 7, bytes([byte ^ 1]))
    ring_format.clear(arena, ring, 2)  # region of step 6: being overwritten
    _, held = memory.read(arena)
    assert [s.step for s in held] == [5, 4]
    assert memory.verify(held[0]) == "step 5: 'w' fails its checksum"
    assert memory.verify(held[1]) is None
    arena.close()


def test_a_warm_verdict_holds_only_for_the_snapshot_it_checked() -> None:
    arena, ring, snaps = _ring_with([4, 5, 6])
    slot = snaps[1].tensors[0][1]
    arena.write(slot.offset + 7, bytes([arena.read(slot.offset + 7, 1)[0] ^ 1]))
    warm = tiers.Warm(arena, 0)
    warm.wait()
    _, held = memory.read(arena)
    verdicts = {s.step: warm.verdict(s, ring) for s in held}
    assert verdicts == {
        6: (True, None),
        5: (True, "step 5: 'w' fails its checksum"),
        4: (True, None),
    }
    assert warm.pool is None  # no optimizer state in these snapshots
    # Region 0 staged anew after the warm-up (another step, another sequence number): its
    # verdict is unknown, so the restore checks its digests itself.
    ring_format.clear(arena, ring, 0)
    base = ring.data_base(0)
    again = memory.Snapshot(
        step=7, rank=0, world_size=1, arena=arena, region=0,
        tensors=[(MetadataIndex("w"), Slot(base, 1024, torch.float32, (256,)))],
        payloads=[], digests=[], seq=9,
    )  # fmt: skip
    memory.seal(again, ring)
    [newest, *_] = memory.read(arena)[1]
    assert newest.step == 7 and warm.verdict(newest, ring) == (False, None)
    assert warm.verdict(held[2], ring) == (False, None)  # step 4's region holds step 7 now
    arena.close()


def test_the_warm_up_fills_the_step_the_nodes_other_ranks_hold_too(tmp_path: Path) -> None:
    # Rank 0 outlived rank 1 by a step: it holds 6, 5, 4 and rank 1 5, 4. The restore's
    # all-gather will agree on 5, so the warm-up copies step 5's optimizer state ahead.
    root, fqn = tmp_path / "ckpt", "optim.state.w.exp_avg"
    mine, _, _ = _ring_with([4, 5, 6], fqn=fqn, rank=0, world_size=2)
    theirs, _, _ = _ring_with([4, 5], fqn=fqn, rank=1, world_size=2)
    unrelated, _, _ = _ring_with([1], fqn=fqn, rank=1, world_size=2)
    kept = MemoryKeeper()
    try:
        for key, arena in [(tiers._key(root, 0), mine), (tiers._key(root, 1), theirs)]:
            assert keeper.put(kept.addr, key, arena.fd)
        assert keeper.put(kept.addr, tiers._key(tmp_path / "ckpt2", 1), unrelated.fd)
        assert tiers._held_nearby(kept.addr, root, 0) == [{4, 5}]

        def filled(others: Any = list) -> set[int]:
            warm = tiers.Warm(mine, 0, others)
            warm.wait()
            assert warm.pool is not None
            steps = {tag[0][1] for tag in warm.pool._filled.values()}
            warm.pool.close()
            return steps

        assert filled(functools.partial(tiers._held_nearby, kept.addr, root, 0)) == {5}
        assert filled() == {6}  # no other rank known: the newest
    finally:
        kept.close()
        for arena in (mine, theirs, unrelated):
            arena.close()


def test_an_arena_without_a_ring_holds_nothing() -> None:
    arena = Arena()
    arena.ensure(1 << 16)
    assert memory.read(arena) == (None, [])
    arena.close()


def test_a_save_never_goes_to_the_region_being_persisted() -> None:
    arena, ring, _ = _ring_with([4, 5, 6])
    staging = Staging(rank=0, regions=3, arena=arena)
    assert staging.sealed == {0: 1, 1: 2, 2: 3}
    staging.slots = [Slot(0, 1024, torch.float32, (256,))]
    # The oldest (region 0, step 4) is what the writer reads: the next oldest is overwritten.
    region, slots = staging.begin(pinned=0)
    assert region == 1 and slots[0].offset == ring.data_base(1)
    assert [s.step for s in memory.read(arena)[1]] == [6, 4]  # cleared before the copy
    assert staging.begin(pinned=None)[0] == 1  # an empty region before any sealed one
    assert staging.begin(pinned=1)[0] == 0  # then the oldest
    arena.close()


def test_the_keeper_hands_an_arena_to_the_next_process() -> None:
    kept = MemoryKeeper()
    try:
        arena = Arena()
        arena.ensure(1 << 20)
        arena.write(100, b"survives")
        assert keeper.put(kept.addr, "ckpt#rank0", arena.fd)
        arena.close()  # the writing process is gone
        code = (
            "import mmap, os, sys\n"
            "from unbroken.checkpoint.tiers import keeper\n"
            "fd = keeper.get(sys.argv[1], 'ckpt#rank0')\n"
            "mm = mmap.mmap(fd, os.fstat(fd).st_size)\n"
            "print(mm[100:108].decode(), keeper.get(sys.argv[1], 'other'))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, kept.addr], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.split() == ["survives", "None"], out.stderr
        assert kept.held() == {"ckpt#rank0": 2 << 20}
        other = os.memfd_create("other")
        os.ftruncate(other, 4096)
        assert keeper.put(kept.addr, "ckpt#rank0", other)  # a new arena replaces the old
        os.close(other)
        assert kept.held() == {"ckpt#rank0": 4096}
    finally:
        kept.close()
    assert kept.held() == {}
    assert keeper.get(kept.addr, "ckpt#rank0") is None  # gone with the agent
    assert not keeper.put("@unbroken-keeper-nobody", "k", 0)


def test_a_memfd_from_the_keeper_maps_the_same_pages() -> None:
    kept = MemoryKeeper()
    try:
        arena = Arena()
        arena.ensure(1 << 16)
        keeper.put(kept.addr, "k", arena.fd)
        fd = keeper.get(kept.addr, "k")
        assert fd is not None
        other = Arena.adopt(fd)
        arena.write(0, b"both")
        assert other.read(0, 4) == b"both" and other.size == arena.size
        other.close()
        arena.close()
    finally:
        kept.close()


def test_snapshots_every_step_persist_every_third_and_restore_the_last(tmp_path: Path) -> None:
    """Snapshot often, persist rarely: steps 0-4 are all staged, only step 2 reaches disk; the
    next Checkpointer after an abort restores step 4 from memory, bit for bit."""
    led = Ledger(tmp_path, run="t", rank=0)
    model, optim = mlp(0)
    state = {"model": model, "optim": optim}
    ck = Checkpointer(
        tmp_path / "ckpt",
        ledger=led,
        every_steps=3,
        snapshot_every=1,
        overlap=True,
        memory_slots=3,  # a ring: snapshots while a save persists
    )
    for step in range(5):
        train_step(model, optim)
        assert ck.maybe_save(step, state)
    ck.wait()  # step 2 committed
    ck.wait_staged()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ck.abort()
    assert layout.committed_steps(tmp_path / "ckpt") == [2]
    model2, optim2 = mlp(1)
    with Checkpointer(tmp_path / "ckpt", ledger=led) as ck2:
        assert ck2.restore({"model": model2, "optim": optim2}) == 4
    assert all(torch.equal(v, want[k]) for k, v in model2.state_dict().items())
    led.close()
    events = read_events(tmp_path)
    stages = [e for e in events if e.kind == "ckpt_stage" and e.get("part") is None]
    assert [(e.get("step"), e.get("durable")) for e in stages] == [
        (0, False), (1, False), (2, True), (3, False), (4, False),
    ]  # fmt: skip
    assert {e.get("region") for e in stages} == {0, 1, 2}  # three regions in turn
    [load] = [e for e in events if e.kind == "ckpt_load"]
    assert (load.get("tier"), load.get("source"), load.get("memory")) == (
        "memory", "process", [[4, 3, 2]],
    )  # fmt: skip


def test_snapshot_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="snapshot_every=2 needs memory_tier=True"):
        CheckpointConfig(snapshot_every=2, memory_tier=False)
    with pytest.raises(ValueError, match="memory_slots must be >= 1"):
        CheckpointConfig(memory_slots=0)
    assert CheckpointConfig(memory_tier=False, memory_slots=1).regions == 1
    lean = CheckpointConfig()  # one snapshot and the spare a rescue uses
    assert lean.lean and (lean.regions, lean.resident_regions) == (2, 1)
    ring = CheckpointConfig(memory_slots=3)
    assert not ring.lean and (ring.regions, ring.resident_regions) == (3, 3)
    peered = CheckpointConfig(peers=("a:1#t", "b:2#t"), peer_index=0)  # replicas lag: two
    assert not peered.lean and (peered.regions, peered.resident_regions) == (2, 2)
    assert CheckpointConfig(snapshot_every=4).snapshot_due(3)
    assert not CheckpointConfig(snapshot_every=4).snapshot_due(4)
