"""The layout of the memory tier's snapshots in an arena: a ring of regions, each with a header.

An arena holds a page of ring header (``Ring``: how many regions, their sizes), then the
regions, each [a page of header][metadata][tensor bytes]. A region's header (``Head``: the
step, the metadata's length and xxh3 digest, a sequence number) is written last, after its
bytes and metadata, and cleared first, before they are overwritten (``memory`` does both), so a
region reads as sealed or empty, never torn.

Only bytes and headers here, no torch: the node agent's peer service (``tiers.peers``) keeps
and serves replicas with this module alone, and so starts without importing torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from unbroken.checkpoint.staging.arena import Arena

PAGE = 4096
_RING = struct.Struct("<8sQQQ")  # magic, regions, data bytes per region, metadata capacity
_RING_MAGIC = b"UNBRING1"
_HEAD = struct.Struct("<8sqQQQ")  # magic, step, metadata length, its digest, sequence number
_HEAD_MAGIC = b"UNBSNAP1"
_MIN_META = 64 << 10


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class Ring:
    """Where the regions of an arena lie: a page of ring header, then ``regions`` regions of
    [a page of header][``meta_cap`` bytes of metadata][``data_bytes`` of tensors]."""

    regions: int
    data_bytes: int
    meta_cap: int

    @property
    def stride(self) -> int:
        return PAGE + self.meta_cap + _page(self.data_bytes)

    @property
    def total(self) -> int:
        """Bytes of arena the ring needs."""
        return PAGE + self.regions * self.stride

    def base(self, region: int) -> int:
        return PAGE + region * self.stride

    def data_base(self, region: int) -> int:
        """Offset of the region's tensor bytes (a layout's slot offsets count from here)."""
        return self.base(region) + PAGE + self.meta_cap

    @staticmethod
    def sized(regions: int, data_bytes: int, meta_bytes: int, old: Ring | None) -> Ring:
        """The ring for this much data and metadata; ``old`` when it still fits (so a ring
        adopted after a restart keeps its snapshots)."""
        if (
            old is not None
            and (old.regions, old.data_bytes) == (regions, data_bytes)
            and meta_bytes <= old.meta_cap
        ):
            return old
        return Ring(regions, data_bytes, _page(max(_MIN_META, 2 * meta_bytes)))


@dataclass(frozen=True)
class Head:
    """A sealed region's header."""

    step: int
    meta_len: int
    meta_digest: int
    seq: int
    """Order of staging within the ring (higher: newer)."""


def write_ring(arena: Arena, ring: Ring) -> None:
    """Lay ``ring`` out in ``arena``: every region empty."""
    for region in range(ring.regions):
        clear(arena, ring, region)
    arena.write(0, _RING.pack(_RING_MAGIC, ring.regions, ring.data_bytes, ring.meta_cap))


def read_ring(arena: Arena) -> Ring | None:
    """The ring laid out in ``arena``, or None (a fresh or foreign arena)."""
    if arena.size < PAGE:
        return None
    magic, regions, data_bytes, meta_cap = _RING.unpack(arena.read(0, _RING.size))
    ring = Ring(regions, data_bytes, meta_cap)
    if magic != _RING_MAGIC or regions < 1 or ring.total > arena.size:
        return None
    return ring


def clear(arena: Arena, ring: Ring, region: int) -> None:
    """Mark ``region`` empty (before its bytes are overwritten)."""
    arena.write(ring.base(region), bytes(_HEAD.size))


def write_head(arena: Arena, ring: Ring, region: int, head: Head) -> None:
    """Seal ``region``: its bytes and metadata are in place."""
    packed = _HEAD.pack(_HEAD_MAGIC, head.step, head.meta_len, head.meta_digest, head.seq)
    arena.write(ring.base(region), packed)


def read_head(arena: Arena, ring: Ring, region: int) -> Head | None:
    """The header of ``region``, or None (empty)."""
    magic, step, meta_len, meta_digest, seq = _HEAD.unpack(
        arena.read(ring.base(region), _HEAD.size)
    )
    return Head(step, meta_len, meta_digest, seq) if magic == _HEAD_MAGIC else None


def sealed_as(arena: Arena, ring: Ring, region: int) -> tuple[int, int] | None:
    """(step, sequence number) of the snapshot sealed in ``region``, or None (empty)."""
    head = read_head(arena, ring, region)
    return None if head is None else (head.step, head.seq)


def meta_intact(arena: Arena, ring: Ring, region: int, head: Head) -> bool:
    """Whether the metadata of sealed ``region`` is there whole (its length and digest)."""
    return head.meta_len <= ring.meta_cap and (
        arena.digest(ring.base(region) + PAGE, head.meta_len) == head.meta_digest
    )


def held_steps(arena: Arena) -> list[int]:
    """Steps of the regions sealed with their metadata whole, newest first: what a peer holds,
    told without reading the metadata (the restore that fetches one checks every digest)."""
    ring = read_ring(arena)
    if ring is None:
        return []
    heads = [(r, read_head(arena, ring, r)) for r in range(ring.regions)]
    whole = [h for r, h in heads if h is not None and meta_intact(arena, ring, r, h)]
    return [h.step for h in sorted(whole, key=lambda h: h.seq, reverse=True)]
