"""The memory tier's parts on their own: the ring of snapshot regions in an arena (sealed last,
cleared first, checked by digest), the region a save goes to, and the agent's memory keeper
handing an arena from one process to the next."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from unbroken.checkpoint import keeper, memory
from unbroken.checkpoint.arena import Arena, Slot, copy_into, plan_slots
from unbroken.checkpoint.staging import Staging
from unbroken.launcher.keeper import MemoryKeeper


def _ring_with(steps: list[int]) -> tuple[Arena, memory.Ring, list[memory.Snapshot]]:
    """An arena of three regions holding ``steps`` (one tensor each: a ramp of step + i)."""
    slots, total = plan_slots([(torch.float32, (256,), 1024)])
    ring = memory.Ring.sized(3, total, 0, None)
    arena = Arena()
    arena.ensure(ring.total)
    memory.write_ring(arena, ring)
    snaps = []
    for region, step in enumerate(steps):
        base = ring.data_base(region)
        slot = Slot(base + slots[0].offset, 1024, torch.float32, (256,))
        copy_into(arena, [(torch.arange(256, dtype=torch.float32) + step, slot)])
        snap = memory.Snapshot(
            step=step, rank=0, world_size=1, arena=arena, region=region,
            tensors=[(MetadataIndex("w"), slot)], payloads=[(MetadataIndex("p"), b"x")],
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
    memory.clear(arena, ring, 2)  # region of step 6: being overwritten
    _, held = memory.read(arena)
    assert [s.step for s in held] == [5, 4]
    assert memory.verify(held[0]) == "step 5: 'w' fails its checksum"
    assert memory.verify(held[1]) is None
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
            "from unbroken.checkpoint import keeper\n"
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
