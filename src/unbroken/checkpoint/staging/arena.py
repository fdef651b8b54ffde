"""Staging memory shared with the writer process: allocated once, reused, grown on demand.

The arena is a memfd (anonymous shared memory, the same tmpfs pages as a /dev/shm file, but
with no name to leak when a process is SIGKILLed), mapped here and, through its fd passed over
the writer's socket, in the writer; under ``unbroken-run`` the node agent holds the fd too, so
the arena outlives this process (``adopt`` maps it in the next one; see ``memory``). Pages
are touched once at allocation so that a save copies into already-faulted memory (several
times faster than copying while faulting). On CUDA the mapping is page-locked with
cudaHostRegister so device-to-host copies run asynchronously.

torch is imported on first use, not with the module: the node agent's peer service keeps
replicas in arenas as bytes only (``ring_format``) and starts without it.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ALIGN = 64
_GROW_QUANTUM = 2 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one tensor item lives in the arena."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def plan_slots(specs: list[tuple[torch.dtype, tuple[int, ...], int]]) -> tuple[list[Slot], int]:
    """Lay out ``(dtype, shape, nbytes)`` specs back to back, 64-byte aligned; returns the
    slots and the total size."""
    slots = []
    offset = 0
    for dtype, shape, nbytes in specs:
        slots.append(Slot(offset, nbytes, dtype, shape))
        offset = _align(offset + nbytes)
    return slots, offset


class Arena:
    """A growable shared-memory buffer. Not thread-safe: one owner."""

    def __init__(self, *, name: str = "unbroken-ckpt") -> None:
        self._name = name
        self.fd = -1
        self.size = 0
        self.generation = 0
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._pinned = False
        self._pin_tried = False
        self._touch = 0

    @classmethod
    def adopt(cls, fd: int, *, name: str = "unbroken-ckpt") -> Arena:
        """An arena over an existing memfd (another process's, handed over): mapped, not
        cleared; takes ownership of ``fd``."""
        arena = cls(name=name)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        arena.fd, arena.size, arena._mm = fd, size, mm
        arena.generation = 1
        return arena

    def ensure(self, nbytes: int, *, pin: bool = False, touch: int | None = None) -> bool:
        """Make the arena at least ``nbytes``; returns True when it was (re)allocated, in
        which case the writer must be handed the new fd.

        Args:
            nbytes: The size needed.
            pin: Page-lock the touched part for device-to-host copies (CUDA only).
            touch: Fault in (and pin) only the first this many bytes; the rest takes memory
                only once written (None: all).
        """
        if nbytes <= self.size:
            self._touch = self.size if touch is None else min(touch, self.size)
            if pin and not self._pinned and not self._pin_tried:
                self._pin()  # an adopted arena: pin it in place, keeping what it holds
            return False
        size = max(self.size, (nbytes + _GROW_QUANTUM - 1) // _GROW_QUANTUM * _GROW_QUANTUM)
        self.close()
        fd = os.memfd_create(self._name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size, self._mm = fd, size, mm
        self._touch = size if touch is None else min(touch, size)
        if self._touch:  # fault the pages in now, not during a save
            self._tensor()[: self._touch].fill_(0)
        if pin:
            self._pin()
        self.generation += 1
        logger.info("staging arena: %.1f MiB (generation %d)", size / 2**20, self.generation)
        return True

    @property
    def resident(self) -> int:
        """Bytes of memory the arena takes (its pages written or touched; 0 when closed)."""
        return os.fstat(self.fd).st_blocks * 512 if self.fd >= 0 else 0

    def view(self, slot: Slot) -> torch.Tensor:
        """The arena's bytes for ``slot`` as a tensor of the slot's dtype and shape."""
        raw = self._tensor()[slot.offset : slot.offset + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape)

    def _tensor(self) -> torch.Tensor:
        """The whole mapping as one uint8 tensor (made on first use)."""
        if self._bytes is None:
            import torch

            self._bytes = torch.frombuffer(self._mapped(), dtype=torch.uint8)
        return self._bytes

    def _mapped(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError("the staging arena is closed")
        return self._mm

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` of the arena at ``offset``; ValueError once it is closed (a
        reader on another thread, the replicator, may outlive it)."""
        return self._mapped()[offset : offset + nbytes]

    def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` into the arena at ``offset``."""
        assert self._mm is not None
        self._mm[offset : offset + len(data)] = data

    def window(self, offset: int, nbytes: int) -> memoryview:
        """The arena's bytes at ``offset``, writable, without a copy (for socket I/O); release
        it before the arena is closed. ValueError once it is closed."""
        return memoryview(self._mapped())[offset : offset + nbytes]

    def digest(self, offset: int, nbytes: int) -> int:
        """xxh3-64 of ``nbytes`` at ``offset`` (the GIL is released while it hashes)."""
        assert self._mm is not None
        with memoryview(self._mm) as whole, whole[offset : offset + nbytes] as part:
            return xxhash.xxh3_64_intdigest(part)

    def release(self, offset: int, nbytes: int) -> None:
        """Give the memory of ``nbytes`` at ``offset`` (page-aligned) back: it reads as zeros
        and takes memory again only once written (``MADV_REMOVE``, here and in every process
        that maps the arena). Pinned pages stay as they are."""
        mm = self._mapped()
        end = min(offset + nbytes, self.size)
        if end <= offset or (self._pinned and offset < (self._touch or self.size)):
            return
        try:
            mm.madvise(mmap.MADV_REMOVE, offset, end - offset)
        except OSError as e:  # a kernel without hole punching in shared memory: kept
            logger.debug("MADV_REMOVE of the staging arena: %s", e)

    def _pin(self) -> None:
        import torch

        self._pin_tried = True
        if not torch.cuda.is_available():
            return
        nbytes = self._touch or self.size
        err = torch.cuda.cudart().cudaHostRegister(self._tensor().data_ptr(), nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister of the staging arena failed (%s); copies block", err)
            return
        self._pinned = True

    def close(self) -> None:
        if self._bytes is not None and self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._bytes.data_ptr())
        self._pinned = self._pin_tried = False
        self._bytes = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                logger.debug("staging arena still referenced at close")
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.size = 0


def copy_into(arena: Arena, pairs: list[tuple[torch.Tensor, Slot]]) -> None:
    """Copy each source tensor into its slot; waits for device copies to finish."""
    copy_tensors([src for src, _ in pairs], [arena.view(slot) for _, slot in pairs])


def copy_tensors(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """Copy each source into its destination (of the same dtype and shape: arena views);
    waits for device copies to finish. Host sources go in one ``_foreach_copy_`` call (one
    dispatch instead of one per tensor, whose overhead adds up over many small tensors)."""
    import torch

    if not srcs:
        return
    with torch.no_grad():
        if any(src.is_cuda for src in srcs):
            for src, dst in zip(srcs, dsts, strict=True):
                dst.copy_(src, non_blocking=src.is_cuda)
            torch.cuda.current_stream().synchronize()
        else:
            torch._foreach_copy_(dsts, srcs)
