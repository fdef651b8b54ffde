"""Staging: the copy of a training state into a region of the shared arena.

``Staging`` owns one Checkpointer's arena, laid out as a ring of regions (``ring_format.Ring``): the
item layout (planned once and cached while the tensors' shapes stay; a new layout or a grown
arena is handed to the writer, and a new arena to the node agent's keeper), the choice of the
region a save goes to (never the one the writer is persisting), the copy of the tensors that
must be copied before ``save`` returns, the background copy of the rest (``overlap``) and the
optimizer pre-hooks that wait for it, and the seal that makes a region a snapshot the memory
tier can restore (``memory``).

Thread use: the training thread calls everything; the background copy and seal run on one
stager thread, started at the first save that has background work. A save waits for the
previous background copy first (``wait``), so the two never touch the ring at the same time.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from unbroken.checkpoint.staging import journal, memory, ring_format
from unbroken.checkpoint.staging.arena import Arena, Slot, copy_tensors, plan_slots

logger = logging.getLogger(__name__)

SEAL_LATER_BYTES = 32 << 20
"""A snapshot of at least this many tensor bytes is sealed on the stager thread, not in the
save: its digests (xxh3 over every byte) take about as long as the copy itself, and nothing
needs them before a restore. Whatever reads the region (the next save, a rescue, an abort
handing the arena to the memory tier, the writer) comes after the seal; below this size the
digests take under 2 ms and the seal stays in the save, without a thread hand-off."""

_META_PER_ITEM = 512
"""Bytes of snapshot metadata budgeted per tensor item (its index, slot and digest)."""


@dataclass
class _Region:
    """One region's part of the current layout."""

    slots: list[Slot]
    views: list[torch.Tensor]
    """The arena's bytes of each slot as a tensor (copy destinations)."""
    held: list[tuple[Any, Slot]] | None = None
    """(index, slot) of each tensor item, made when first asked for."""


class WriterLink(Protocol):
    """What staging needs of the writer: a message, with file descriptors riding along."""

    def send(self, msg: dict[str, Any], *, fds: tuple[int, ...] = ()) -> None: ...


class Staging:
    """One Checkpointer's staging arena of ``regions`` regions; ``arena`` may be an adopted
    one (memory tier), whose sealed regions stay while the layout fits. ``on_arena(fd)`` is
    called with every newly allocated arena (the node agent's keeper holds it);
    ``on_sealed(arena, ring, region, seq)`` as each snapshot is sealed, on the sealing thread,
    without blocking (the peer replicator)."""

    def __init__(
        self,
        *,
        rank: int,
        regions: int = 1,
        lean: bool = False,
        arena: Arena | None = None,
        on_arena: Callable[[int], None] | None = None,
        on_sealed: Callable[[Arena, ring_format.Ring, int, int], None] | None = None,
    ) -> None:
        self.rank = rank
        self.regions = regions
        self.lean = lean
        """One snapshot in region 0, overwritten in place once the ranks agree; the other
        region a spare for rescues, its memory given back once region 0 holds a newer step."""
        self.arena = arena if arena is not None else Arena()
        self.ring: ring_format.Ring | None = None
        self.sealed: dict[int, int] = {}
        """Region -> sequence number of the sealed snapshots this arena holds."""
        if arena is not None:
            self.ring, held = memory.read(arena)
            self.sealed = {s.region: s.seq for s in held}
        self.seq = max(self.sealed.values(), default=0) + 1
        self.journal: journal.Journal | None = None
        """Where each note's per-rank values go, for a restore after a SIGKILL (``journal``)."""
        self.journaled: journal.Entry | None = None
        """What the previous process of this rank journaled last."""
        self._spare: set[int] = set(range(1, regions)) if arena is not None else set()
        """Lean: the regions but 0 that may hold memory (written since given back)."""
        self._replaces = False
        """Lean: the snapshot being staged replaces the one in region 0 (not a rescue)."""
        self.slots: list[Slot] = []
        """The slot of every tensor item of the current layout (offsets in a region)."""
        self.layout_id = 0
        """Id of the current layout, as the writer knows it."""
        self._on_arena = on_arena
        self._sig: tuple[Any, ...] | None = None
        self._indices: list[Any] = []
        self._regions: dict[int, _Region] = {}
        self._writer_has_arena = False
        self._writer_layout = 0  # the layout id the writer was sent
        self._thread: threading.Thread | None = None
        self.waiting_for = "overlap"
        """What the stager's last job does, as a wait for it is recorded: "overlap" (copies),
        "seal" (only seals: ``SEAL_LATER_BYTES``) or "prepare" (``prepare_later``)."""
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._hooked: dict[int, Any] = {}
        self._on_sealed = on_sealed

    @property
    def size(self) -> int:
        """Bytes of memory the staging arena takes (shared with the writer; its pages in use,
        not a lean spare's untouched ones)."""
        return self.arena.resident

    def new_writer(self) -> None:
        """The writer was replaced (the last one was killed or died): the next ``prepare``
        hands the new one the arena and the layout."""
        self._writer_has_arena, self._writer_layout = False, 0

    def prepare(self, tensors: list[Any], payload_bytes: int, writer: WriterLink | None) -> float:
        """Lay out the ring for these resolved items (cached while shapes stay), grow the arena
        if needed, and hand the writer a new layout or arena (None: no writer now, a snapshot
        while storage fails: it gets them with the next save); returns allocation seconds."""
        sig = tuple(i.layout for i in tensors)
        t0 = time.time()
        meta_bytes = payload_bytes + _META_PER_ITEM * (len(tensors) + 8)
        ring = self.ring
        if sig != self._sig or ring is None or meta_bytes > ring.meta_cap:
            self._regions.clear()  # before the arena may be reallocated: no view of it stays
            specs = [
                (i.tensor.dtype, tuple(i.tensor.shape), i.tensor.numel() * i.tensor.element_size())
                for i in tensors
            ]
            self.slots, total = plan_slots(specs)
            self._indices = [i.write_item.index for i in tensors]
            new_ring = ring_format.Ring.sized(self.regions, total, meta_bytes, ring)
            pin = any(i.tensor.is_cuda for i in tensors)
            touch = new_ring.base(1) if self.lean else None  # the spare: only when used
            fresh = self.arena.ensure(new_ring.total, pin=pin, touch=touch)
            if fresh or new_ring != ring:
                ring_format.write_ring(self.arena, new_ring)
                self.sealed.clear()
                if self.lean:
                    self._spare.update(range(1, new_ring.regions))
                    self._release(new_ring, keep=0)
            self.ring = new_ring
            if fresh and self._on_arena is not None:
                self._on_arena(self.arena.fd)
            if fresh:
                self._writer_has_arena = False
            if sig != self._sig:
                self.layout_id += 1
            self._sig = sig
        if writer is None:
            return time.time() - t0
        if not self._writer_has_arena:
            writer.send({"type": "arena", "size": self.arena.size}, fds=(self.arena.fd,))
            self._writer_has_arena = True
        if self._writer_layout != self.layout_id:
            entries = [
                (i.write_item, s) for i, s in zip(tensors, self.slots, strict=True) if i.persist
            ]
            writer.send({"type": "layout", "layout_id": self.layout_id, "entries": entries})
            self._writer_layout = self.layout_id
        return time.time() - t0

    def begin(self, *, pinned: int | None, rescue: bool = False) -> tuple[int, list[Slot]]:
        """Pick the region for a new snapshot (an empty one, else the oldest; never ``pinned``,
        the one the writer reads; lean: region 0, but a ``rescue`` picks so) and mark it
        empty; its index and the items' slots in it."""
        ring = self.ring
        assert ring is not None
        free = [r for r in range(ring.regions) if r != pinned] or [0]
        self._replaces = self.lean and not rescue
        if self._replaces:
            region = 0
        else:
            region = min(free, key=lambda r: self.sealed.get(r, -1))
            if region:
                self._spare.add(region)
        self.sealed.pop(region, None)
        ring_format.clear(self.arena, ring, region)
        return region, self._region(region).slots

    def _region(self, region: int) -> _Region:
        """``region``'s slots and arena views for the current layout (made once per layout)."""
        cached = self._regions.get(region)
        if cached is None:
            assert self.ring is not None
            base = self.ring.data_base(region)
            slots = [Slot(base + s.offset, s.nbytes, s.dtype, s.shape) for s in self.slots]
            views = [self.arena.view(s) for s in slots]
            cached = self._regions[region] = _Region(slots, views)
        return cached

    def split(
        self, region: int, items: list[Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The sources and ``region``'s destinations of the resolved tensor ``items``, those to
        copy now and those to copy in the background (``background``)."""
        now_src: list[torch.Tensor] = []
        now_dst: list[torch.Tensor] = []
        later_src: list[torch.Tensor] = []
        later_dst: list[torch.Tensor] = []
        for item, dst in zip(items, self._region(region).views, strict=True):
            if item.background:
                later_src.append(item.tensor)
                later_dst.append(dst)
            else:
                now_src.append(item.tensor)
                now_dst.append(dst)
        return now_src, now_dst, later_src, later_dst

    def snapshot(self, step: int, region: int, *, world_size: int) -> memory.Snapshot:
        """The snapshot of ``step`` being staged in ``region``: its tensors' slots (payloads
        and digests come with ``fill`` and the seal)."""
        cached = self._region(region)
        if cached.held is None:
            cached.held = list(zip(self._indices, cached.slots, strict=True))
        return memory.Snapshot(
            step=step,
            rank=self.rank,
            world_size=world_size,
            arena=self.arena,
            region=region,
            tensors=cached.held,
            payloads=[],
            digests=[],
        )

    def data_base(self, region: int) -> int:
        """Offset of ``region``'s tensor bytes in the arena (what the writer adds)."""
        assert self.ring is not None
        return self.ring.data_base(region)

    def copy_now(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
        """Copy on the calling thread (what must not change before ``save`` returns)."""
        copy_tensors(srcs, dsts)

    def seal_now(self, held: memory.Snapshot) -> None:
        """``held`` is fully copied: seal its region on the calling thread."""
        self._seal(held)

    def copy_later(
        self,
        srcs: list[torch.Tensor],
        dsts: list[torch.Tensor],
        *,
        held: memory.Snapshot,
        payloads: list[Any],
        seal: bool,
        done: Callable[[], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """Copy ``srcs`` to ``dsts``, give ``held`` the resolved ``payloads`` items' values
        (``fill``) and (with ``seal``) seal its region on the stager thread; then ``done()``
        runs there (or ``failed(error)`` when one of them raised)."""
        self._submit(
            (srcs, dsts, held, payloads, seal, done, failed), "overlap" if srcs else "seal"
        )

    def prepare_later(self, tensors: list[Any], payload_bytes: int) -> None:
        """``prepare`` on the stager thread, without a writer: the arena laid out, allocated
        and faulted in (pinned on a GPU) while training goes on, not in the first save. That
        save waits for it if it is not done (``wait``); the writer gets the arena then."""
        self._submit(functools.partial(self._prepare_quietly, tensors, payload_bytes), "prepare")

    def _prepare_quietly(self, tensors: list[Any], payload_bytes: int) -> None:
        try:
            self.prepare(tensors, payload_bytes, None)
        except Exception:  # the first save lays it out again, and raises what it raises
            logger.warning("laying out the staging arena ahead failed", exc_info=True)

    def _submit(self, job: Any, waiting_for: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"unbroken-ckpt-stager-{self.rank}", daemon=True
            )
            self._thread.start()
        self.waiting_for = waiting_for
        self._idle.clear()
        self._jobs.put(job)

    @property
    def copying(self) -> bool:
        """True while a background copy runs."""
        return not self._idle.is_set()

    def wait(self) -> None:
        """Block until the background copy (if any) is done."""
        self._idle.wait()

    def _seal(self, held: memory.Snapshot) -> None:
        assert self.ring is not None
        held.seq = self.seq
        self.seq += 1
        memory.seal(held, self.ring, relative=self.slots)
        self.sealed[held.region] = held.seq
        if self._replaces:  # the step every rank agreed on: a rescue's spare is done with
            self._release(self.ring, keep=0)
        if self._on_sealed is not None:
            self._on_sealed(self.arena, self.ring, held.region, held.seq)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if callable(job):
                try:
                    job()
                finally:
                    self._idle.set()
                continue
            srcs, dsts, held, payloads, seal, done, failed = job
            try:
                copy_tensors(srcs, dsts)
                fill(held, payloads)
                if seal:
                    self._seal(held)
                done()
            except Exception as e:
                logger.exception("background staging of step %d failed", held.step)
                failed(e)
            finally:
                self._idle.set()

    def retain(self, region: int | None) -> None:
        """Forget every snapshot but ``region``'s (None: all), after a restore: the others
        are of steps the restored run has not reached, or never will the same way."""
        if self.ring is None:
            return
        for r in list(self.sealed):
            if r != region:
                ring_format.clear(self.arena, self.ring, r)
                del self.sealed[r]
        if self.lean:
            self._release(self.ring, keep=region)

    def _release(self, ring: ring_format.Ring, *, keep: int | None) -> None:
        """Lean: empty every region but 0 and ``keep`` and give its memory back."""
        for r in range(1, ring.regions):
            if r != keep and r in self._spare:
                self.sealed.pop(r, None)
                ring_format.clear(self.arena, ring, r)
                self.arena.release(ring.base(r), ring.stride)
                self._spare.discard(r)

    def hook(self, state: Mapping[str, Any], wait: Callable[[], None]) -> None:
        """Give every optimizer in ``state`` a step pre-hook calling ``wait`` (once each)."""
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._hooked:
                self._hooked[id(value)] = value.register_step_pre_hook(
                    lambda _opt, _args, _kwargs: wait()
                )

    def stop(self, *, keep_for: Path | None = None) -> None:
        """Remove the hooks and end the stager thread (a background copy finishes first).
        With ``keep_for`` (a checkpoint root), the arena and its sealed snapshots go to the
        memory tier for the next Checkpointer on that root; this one gets a fresh arena."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30.0)
            self._thread = None
        if keep_for is not None and self.sealed:
            self._regions.clear()
            memory.keep(keep_for, self.arena)
            self.arena = Arena()

    def close(self) -> None:
        """Free the arena (after ``stop``; the writer has unmapped it or is gone)."""
        self._regions.clear()
        self.arena.close()
        if self.journal is not None:
            self.journal.close()
            self.journal = None


def fill(held: memory.Snapshot, payloads: list[Any]) -> None:
    """Make the payloads left for later (``StageItem.finish``) and give ``held`` them all."""
    for item in payloads:
        item.finish()
    held.payloads = [(i.write_item.index, i.payload) for i in payloads if i.payload is not None]


def process_memory() -> dict[str, int]:
    """RSS of this process, and the part of it that is shared memory (the arena)."""
    out = {"rss_bytes": 0, "rss_shmem_bytes": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
                elif line.startswith("RssShmem:"):
                    out["rss_shmem_bytes"] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out
