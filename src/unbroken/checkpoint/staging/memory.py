"""The memory tier: recent snapshots in the staging arena, read back after a restart.

The arena is a ring of ``slots`` regions (``Ring``), each holding one staged step: a header,
the step's metadata (which item lies where, each tensor's xxh3 digest, the serialized
non-tensor values) and the tensor bytes. A region's header is written last, after its bytes and
metadata, and cleared first, before they are overwritten, so a process killed mid-copy leaves a
region that reads as empty, never a torn one. The ranks must always hold a step in common:

- one snapshot per rank (lean, ``memory_slots`` 1, the default without the peer tier,
  ``CheckpointConfig.lean``): region 0 holds it, and the
  ranks agree in one all-reduce before any of them replaces it (``Saves.stage``), so a rank
  that faulted before its copy keeps the others' step. A second region is a spare for the
  rescue after a fault (``rescue``); its memory is untouched until then and given back
  (``Arena.release``) once region 0 holds a newer step;
- a ring of two or more (``memory_slots`` N): a rank always holds the step before the one it
  is copying, without agreement.

Two ways a ring outlives what wrote it:

- an in-process restart: ``Checkpointer.abort`` keeps the arena in a per-process table, keyed
  by checkpoint directory (``keep``, ``take``); the next iteration's Checkpointer adopts it;
- a new process (a launcher restart): the node agent holds the arena's memfd (``keeper``) and
  hands it to the next process of the same rank, which maps it; its digests are checked first
  (``verify``), since the process that wrote it died at an unknown point.

``Checkpointer.restore`` gathers every rank's held steps, takes the newest they all hold whose
every copy fits the live state and passes its checks (one more all-gather decides), and copies
it back; else disk. A step staged but not yet committed is fine: every rank's copy is the
state after that same step. For this every rank stages every tensor it holds, the replicated
ones that another rank writes included (``stage_all``); its writer persists only its own.
"""

from __future__ import annotations

import io
import logging
import pickle
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from unbroken.checkpoint import layout
from unbroken.checkpoint.staging.arena import Arena, Slot
from unbroken.checkpoint.staging.ring_format import (
    PAGE,
    Head,
    Ring,
    meta_intact,
    read_head,
    read_ring,
    write_head,
)
from unbroken.checkpoint.state import freshopt
from unbroken.checkpoint.state.resolve import apply_loaded, in_mesh, local_shard, template_for_load

logger = logging.getLogger(__name__)


class Mismatch(Exception):
    """The snapshot does not fit the live state (another model or layout)."""

    live_model = False
    """Raised for a template of the live model's tensors (``prepare`` asks DCP then)."""


@dataclass
class Snapshot:
    """One fully staged step in a region of an arena."""

    step: int
    rank: int
    world_size: int
    arena: Arena
    region: int
    tensors: list[tuple[MetadataIndex, Slot]]
    """Tensor items, in staging order, and their slots (offsets into the arena)."""
    payloads: list[tuple[MetadataIndex, bytes]]
    """Serialized non-tensor items."""
    digests: list[int]
    """xxh3-64 of each tensor item's bytes, in ``tensors`` order."""
    seq: int = 0
    """Order of staging within the ring (higher: newer)."""


def seal(snapshot: Snapshot, ring: Ring, *, relative: list[Slot] | None = None) -> None:
    """Write the digests, metadata and then the header of a fully copied region. Raises
    ValueError when the metadata does not fit the ring (it must be laid out anew).
    ``relative``: the tensors' slots counted from the region's data (else worked out)."""
    arena, region = snapshot.arena, snapshot.region
    snapshot.digests = [arena.digest(s.offset, s.nbytes) for _, s in snapshot.tensors]
    if relative is None:
        base = ring.data_base(region)
        relative = [Slot(s.offset - base, s.nbytes, s.dtype, s.shape) for _, s in snapshot.tensors]
    rel = [(i, s) for (i, _), s in zip(snapshot.tensors, relative, strict=True)]
    meta = pickle.dumps(
        {
            "step": snapshot.step,
            "rank": snapshot.rank,
            "world_size": snapshot.world_size,
            "tensors": rel,
            "payloads": snapshot.payloads,
            "digests": snapshot.digests,
        },
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    if len(meta) > ring.meta_cap:
        raise ValueError(f"snapshot metadata of {len(meta)} bytes > {ring.meta_cap}")
    arena.write(ring.base(region) + PAGE, meta)
    meta_digest = arena.digest(ring.base(region) + PAGE, len(meta))
    write_head(arena, ring, region, Head(snapshot.step, len(meta), meta_digest, snapshot.seq))


def read(arena: Arena) -> tuple[Ring | None, list[Snapshot]]:
    """The ring of ``arena`` and its sealed snapshots, newest first (digests not checked;
    a region whose header or metadata does not check out is left out)."""
    ring = read_ring(arena)
    if ring is None:
        return None, []
    out = []
    for region in range(ring.regions):
        base = ring.base(region)
        head = read_head(arena, ring, region)
        if head is None:
            continue
        if not meta_intact(arena, ring, region, head):
            logger.warning("in-memory snapshot in region %d: metadata damaged", region)
            continue
        step, seq = head.step, head.seq
        try:
            meta = _parse(arena, region, arena.read(base + PAGE, head.meta_len))
        except Exception as e:  # its digest matched: another version wrote it
            logger.warning("in-memory snapshot in region %d unreadable: %s", region, e)
            continue
        data = ring.data_base(region)
        tensors = [
            (i, Slot(data + s.offset, s.nbytes, s.dtype, s.shape)) for i, s in meta["tensors"]
        ]
        if (
            any(s.offset + s.nbytes > base + ring.stride for _, s in tensors)
            or step != meta["step"]
        ):
            continue
        out.append(
            Snapshot(
                step=step,
                rank=meta["rank"],
                world_size=meta["world_size"],
                arena=arena,
                region=region,
                tensors=tensors,
                payloads=list(meta["payloads"]),
                digests=list(meta["digests"]),
                seq=seq,
            )
        )
    return ring, sorted(out, key=lambda s: s.seq, reverse=True)


# Each region's metadata as last parsed, by its bytes: a restore reads the arena its warm-up
# read already, and unpickling hundreds of items with the restricted unpickler is not free.
_parsed: weakref.WeakKeyDictionary[Arena, dict[int, tuple[bytes, dict[str, Any]]]] = (
    weakref.WeakKeyDictionary()
)


def _parse(arena: Arena, region: int, raw: bytes) -> dict[str, Any]:
    """``raw`` metadata unpickled (restricted: an arena may come from another node, see
    ``peers``), or what the same bytes gave last time."""
    seen = _parsed.setdefault(arena, {})
    hit = seen.get(region)
    if hit is not None and hit[0] == raw:
        return hit[1]
    meta = layout.safe_loads(raw)
    seen[region] = (raw, meta)
    return meta


def verify(snapshot: Snapshot, *, untrusted: bool = False) -> str | None:
    """None when every tensor's bytes match their digest, else what did not. ``untrusted``
    (an arena from another node): also every non-tensor value must load with torch's
    ``weights_only`` unpickler (plain values and tensors only), so that applying it (a full
    ``torch.load`` of the same bytes) can construct nothing else."""
    for (index, slot), want in zip(snapshot.tensors, snapshot.digests, strict=True):
        if snapshot.arena.digest(slot.offset, slot.nbytes) != want:
            return f"step {snapshot.step}: {index.fqn!r} fails its checksum"
    for index, data in snapshot.payloads if untrusted else ():
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure: not a value we load
            return f"step {snapshot.step}: {index.fqn!r} is not a plain value ({e})"
    return None


_kept: dict[Path, Arena] = {}


def keep(root: Path, arena: Arena) -> None:
    """Hold ``arena`` for the next Checkpointer on ``root`` in this process."""
    old = _kept.pop(root, None)
    if old is not None and old is not arena:
        old.close()
    _kept[root] = arena


def take(root: Path) -> Arena | None:
    """The arena kept for ``root`` (removed from the table), or None."""
    return _kept.pop(root, None)


@dataclass
class Pending:
    """A checked snapshot load, not applied yet (``apply`` changes the live state)."""

    state: Any
    plan: Any
    mappings: dict[str, Any]
    copies: list[tuple[torch.Tensor, Slot]]
    values: list[tuple[str, bytes]]
    snapshot: Snapshot
    rank: int

    @torch.no_grad()
    def apply(
        self,
        *,
        done: Callable[[torch.Tensor, Slot], bool] | None = None,
        loaded: Mapping[str, tuple[bytes, Any]] | None = None,
    ) -> list[str]:
        """Copy the snapshot into the live state; returns the PerRank keys it had no value for.
        ``done(dst, slot)``: True where ``dst`` holds that slot's bytes already (copied ahead,
        into memory it was carved from: ``freshopt.Pool.fill``). ``loaded``: fqn -> (bytes,
        their ``load_value``) made ahead, each used once, where the bytes are the same."""
        for dst, slot in self.copies:
            if done is None or not done(dst, slot):
                dst.copy_(self.snapshot.arena.view(slot))
        for fqn, data in self.values:
            ahead = loaded.get(fqn) if loaded is not None else None
            value = ahead[1] if ahead is not None and ahead[0] == data else load_value(data)
            set_element(self.plan.template, self.mappings[fqn], value)
        key = _loaded_in_place(self.plan, [fqn for fqn, _ in self.values])
        state = {k: v for k, v in self.state.items() if k != key}
        apply_loaded(state, self.plan, rank=self.rank)
        return list(self.plan.skipped)


def load_value(data: bytes) -> Any:
    """A non-tensor value of a snapshot, as DCP's planner loads it."""
    return torch.load(io.BytesIO(data), weights_only=False)


def _offsets(fqn: str, obj: Any, shards: dict[Any, list[tuple[int, ...]]]) -> list[Any] | None:
    """The offsets of the items ``_create_write_items(fqn, obj)`` makes, or None for one
    BYTE_IO item; a DTensor's worked out once per layout (spec: an optimizer's state is laid
    out like its parameter), a plain tensor's (one chunk at the origin) without making them."""
    if isinstance(obj, DTensor):
        if obj._spec not in shards:
            shards[obj._spec] = [
                tuple(wi.index.offset or ()) for wi in _create_write_items(fqn, obj)
            ]
        return shards[obj._spec]
    if type(obj) in _PLAIN_TENSORS:
        return [(0,) * obj.dim()]
    made = _create_write_items(fqn, obj)
    if len(made) == 1 and made[0].type == WriteItemType.BYTE_IO:
        return None
    return [tuple(wi.index.offset or ()) for wi in made]


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


_FSDP_RESET = "FSDPParam.__init__.<locals>.<lambda>"  # FSDP2's post-load hook: re-pad shards


def _loaded_in_place(plan: Any, values: list[str]) -> str | None:
    """The model's key when the copy has loaded it already: every item of its state dict a
    tensor whose storage is one of its parameters' or buffers' (so ``load_state_dict`` would
    copy each onto itself), and no module with a load hook of its own (FSDP2's resets a
    parameter's shard that was replaced: none was) or its own ``_load_from_state_dict``;
    else None (``apply_loaded`` loads it)."""
    if plan.parts.model is None or plan.parts.model[0] not in plan.template:
        return None
    key, model = plan.parts.model
    if key in plan.parts.per_rank or any(f.startswith(f"{key}.") for f in values):
        return None
    for m in model.modules():
        if m._load_state_dict_pre_hooks or type(m)._load_from_state_dict is not (
            torch.nn.Module._load_from_state_dict
        ):
            return None
        if any(
            getattr(h, "__qualname__", "") != _FSDP_RESET
            for h in m._load_state_dict_post_hooks.values()
        ):
            return None
    if plan.live_model:  # its entries are the live parameters and buffers themselves
        return key
    live = {
        local_shard(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
    }
    flat, _ = flatten_state_dict(plan.template[key])
    return (
        key
        if all(
            isinstance(t, torch.Tensor) and local_shard(t).untyped_storage().data_ptr() in live
            for t in flat.values()
        )
        else None
    )


def prepare(state: Any, snapshot: Snapshot, *, rank: int) -> Pending:
    """Match every item of the live ``state`` with the snapshot, changing nothing; raises
    Mismatch when an item has no counterpart of the same dtype and shape. The model's
    items are its live tensors named by ``naming`` where it can (a fresh process's restore
    skips DCP's renaming walk), else, and when they do not match, DCP's state dict."""
    try:
        return _prepare(state, snapshot, rank=rank, live_model=True)
    except Mismatch as e:
        if not e.live_model:
            raise
        logger.info("the live model's names do not fit the snapshot (%s); asking DCP", e)
        return _prepare(state, snapshot, rank=rank, live_model=False)


def _prepare(state: Any, snapshot: Snapshot, *, rank: int, live_model: bool) -> Pending:
    holds = freshopt.Saved(
        tensors={i.fqn: (s.dtype, s.shape) for i, s in snapshot.tensors},
        values=tuple(i.fqn for i, _ in snapshot.payloads),
    )
    saved = set(holds.tensors) | set(holds.values)
    plan = template_for_load(state, rank=rank, saved_keys=saved, saved=holds, live_model=live_model)
    try:
        return _match(state, snapshot, plan, rank=rank)
    except Mismatch as e:
        e.live_model = plan.live_model
        raise


def _match(state: Any, snapshot: Snapshot, plan: Any, *, rank: int) -> Pending:
    flat, mappings = flatten_state_dict(plan.template)
    slots = {(i.fqn, tuple(i.offset or ())): s for i, s in snapshot.tensors}
    payloads = {i.fqn: data for i, data in snapshot.payloads}
    pending = Pending(state, plan, dict(mappings), [], [], snapshot, rank)
    meshes: dict[int, bool] = {}
    shards: dict[Any, list[tuple[int, ...]]] = {}  # a DTensor's layout -> its shards' offsets
    for fqn, obj in flat.items():
        if isinstance(obj, DTensor) and not in_mesh(obj.device_mesh, meshes):
            continue
        offsets = _offsets(fqn, obj, shards)
        if offsets is None:
            if fqn not in payloads:
                raise Mismatch(f"no value for {fqn!r} in the snapshot")
            pending.values.append((fqn, payloads[fqn]))
            continue
        for offset in offsets:
            slot = slots.get((fqn, offset))
            local = local_shard(obj)
            if slot is None or slot.dtype != local.dtype or slot.shape != tuple(local.shape):
                held = None if slot is None else (slot.dtype, slot.shape)
                raise Mismatch(
                    f"{fqn!r} at {offset}: live {local.dtype} {tuple(local.shape)}, snapshot {held}"
                )
            pending.copies.append((local, slot))
    return pending
