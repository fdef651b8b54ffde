"""Staging: the copy of a training state into the shared arena, and what the arena holds.

``Staging`` owns one Checkpointer's arena: its layout (planned once and cached while the
tensors' shapes stay; a new layout or a grown arena is handed to the writer), the copy of the
tensors that must be copied before ``save`` returns, the background copy of the rest
(``overlap``) and the optimizer pre-hooks that wait for it, and the fully staged snapshot the
memory tier keeps across an in-process restart (``memory``).

Thread use: the training thread calls everything; the background copy runs on one stager
thread, started at the first save that has background work. ``held`` is written by either,
never at the same time (a save waits for the previous background copy first).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from unbroken.checkpoint import memory
from unbroken.checkpoint.arena import Arena, Slot, copy_into, plan_slots

logger = logging.getLogger(__name__)

Pairs = list[tuple[torch.Tensor, Slot]]


class WriterLink(Protocol):
    """What staging needs of the writer: a message, with file descriptors riding along."""

    def send(self, msg: dict[str, Any], *, fds: tuple[int, ...] = ()) -> None: ...


class Staging:
    """One Checkpointer's staging arena; ``arena`` may be an adopted one (memory tier)."""

    def __init__(self, *, rank: int, arena: Arena | None = None) -> None:
        self.rank = rank
        self.arena = arena if arena is not None else Arena()
        self.slots: list[Slot] = []
        """The slot of every tensor item of the current layout, in item order."""
        self.layout_id = 0
        """Id of the current layout, as the writer knows it."""
        self.held: memory.Snapshot | None = None
        """What the arena holds fully staged (the memory tier), or None mid-copy."""
        self._sig: tuple[Any, ...] | None = None
        self._writer_has_arena = False
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._hooked: dict[int, Any] = {}

    @property
    def size(self) -> int:
        """Bytes of staging memory allocated (shared with the writer)."""
        return self.arena.size

    def prepare(self, tensors: list[Any], writer: WriterLink) -> float:
        """Lay out the arena for these resolved items (cached while shapes stay), grow it if
        needed, and hand the writer a new layout or arena; returns allocation seconds."""
        sig = tuple(
            (i.write_item.index.fqn, tuple(i.write_item.index.offset or ()), i.tensor.dtype,
             tuple(i.tensor.shape))
            for i in tensors
        )  # fmt: skip
        t0 = time.time()
        if sig != self._sig:
            specs = [
                (i.tensor.dtype, tuple(i.tensor.shape), i.tensor.numel() * i.tensor.element_size())
                for i in tensors
            ]
            self.slots, total = plan_slots(specs)
            pin = any(i.tensor.is_cuda for i in tensors)
            if self.arena.ensure(total, pin=pin) or not self._writer_has_arena:
                writer.send({"type": "arena", "size": self.arena.size}, fds=(self.arena.fd,))
                self._writer_has_arena = True
            self.layout_id += 1
            entries = [
                (i.write_item, s) for i, s in zip(tensors, self.slots, strict=True) if i.persist
            ]
            writer.send({"type": "layout", "layout_id": self.layout_id, "entries": entries})
            self._sig = sig
        return time.time() - t0

    def copy_now(self, pairs: Pairs) -> None:
        """Copy on the calling thread (what must not change before ``save`` returns)."""
        copy_into(self.arena, pairs)

    def copy_later(
        self,
        pairs: Pairs,
        *,
        held: memory.Snapshot,
        done: Callable[[], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """Copy ``pairs`` on the stager thread; then ``held`` is what the arena holds and
        ``done()`` runs there (or ``failed(error)`` when the copy raised)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"unbroken-ckpt-stager-{self.rank}", daemon=True
            )
            self._thread.start()
        self._jobs.put((pairs, held, done, failed))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, held, done, failed = job
            try:
                copy_into(self.arena, pairs)
                self.held = held
                done()
            except Exception as e:
                logger.exception("background staging of step %d failed", held.step)
                failed(e)

    def hook(self, state: Mapping[str, Any], wait: Callable[[], None]) -> None:
        """Give every optimizer in ``state`` a step pre-hook calling ``wait`` (once each)."""
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._hooked:
                self._hooked[id(value)] = value.register_step_pre_hook(
                    lambda _opt, _args, _kwargs: wait()
                )

    def stop(self, *, keep_for: Path | None = None) -> None:
        """Remove the hooks and end the stager thread (a background copy finishes first).
        With ``keep_for`` (a checkpoint root), the arena and its fully staged step go to the
        memory tier for the next Checkpointer on that root; this one gets a fresh arena."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30.0)
            self._thread = None
        if keep_for is not None and self.held is not None:
            memory.keep(keep_for, self.held)
            self.arena = Arena()

    def close(self) -> None:
        """Free the arena (after ``stop``; the writer has unmapped it or is gone)."""
        self.arena.close()
