"""``Checkpointer``: asynchronous sharded checkpoints with atomic, verified commits.

The trainer is blocked only while a save resolves its state and copies it into the staging
arena (or, with ``overlap``, only for the part that may change before ``optimizer.step``);
the rank's persistent writer process writes, fsyncs, checksums and - on rank 0 - commits.

Contract of ``save`` (snapshot semantics): the checkpoint holds the values the state had when
``save`` was called. Without ``overlap`` everything is copied before ``save`` returns. With
``overlap``, parameters and optimizer state are copied on a background thread while the next
forward/backward runs; each optimizer in the state gets a step pre-hook that waits for that
copy, so ``optimizer.step()`` never changes them mid-copy. Code that changes parameters in
place by other means (an EMA, manual edits) must call ``wait_staged()`` first.

At most one save is in flight per rank. A save that comes while the previous one is still
persisting is skipped or waits for it (``on_busy``; default "skip", see CheckpointConfig).
Across ranks nothing is collective: a rank that skips leaves a marker and the coordinator
abandons that step rather than waiting for it. A checkpoint directory must be on storage every
rank sees (one machine, or a shared filesystem across nodes).

Failures: the writer's death is noticed at once (end of its socket) and raised as
``CheckpointError`` by the next call; a save not durable within ``persist_timeout_s`` is
reported (``ckpt_fail``), its writer killed, and the error raised by the next call; a save the
writer reports failed is raised once by the next call, and later saves go on. No failure
touches an older committed checkpoint.

The parts: ``staging`` (the arena and the copy into it), ``inflight`` (the save in flight,
its writer process, its outcome), ``restore`` and ``memory`` (disk and memory tiers).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint import layout, memory
from unbroken.checkpoint.config import CheckpointConfig, CheckpointError
from unbroken.checkpoint.hooks import WriterHooks
from unbroken.checkpoint.inflight import CheckpointStats, Inflight
from unbroken.checkpoint.resolve import ResolveCache, resolve_for_save
from unbroken.checkpoint.restore import RestoreResult
from unbroken.checkpoint.restore import restore as _restore
from unbroken.checkpoint.staging import Pairs, Staging
from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev
from unbroken.ledger.active import current as active_ledger
from unbroken.mask import masked

__all__ = ["CheckpointStats", "Checkpointer"]

logger = logging.getLogger(__name__)


_created: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def open_checkpointers() -> list[Checkpointer]:
    """This process's Checkpointers not yet closed or aborted (``unbroken.run`` aborts those a
    failed iteration left open, and reports their newest commit in the launcher heartbeat)."""
    return [c for c in _created if not c._closed]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _memory() -> dict[str, int]:
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


class Checkpointer:
    """Saves and restores a training state under ``directory``; see the module docstring.

    ``fields`` override ``config`` (CheckpointConfig): ``every_steps``, ``keep``, ``mode``,
    ``on_busy``, ``overlap``, ``persist_timeout_s``, ... Rank and world size come from the
    default process group when one is initialized. ``ledger`` records every save and load
    (None: the active ledger of ``unbroken.run``, else nothing); ``hooks`` go to the writer process (fault injection and
    tests, see ``unbroken.checkpoint.hooks``; None: none). Use as a context manager or call
    ``close()``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ledger: Recorder | None = None,
        hooks: WriterHooks | None = None,
        config: CheckpointConfig | None = None,
        **fields: Any,
    ) -> None:
        self.config = dataclasses.replace(config or CheckpointConfig(), **fields)
        self.root = Path(directory).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size = _world()
        active = active_ledger() if ledger is None else ledger
        self._ledger: Recorder = NULL if active is None else active
        self._hooks = hooks
        self._stats = CheckpointStats()
        self._inflight = Inflight(
            root=self.root,
            rank=self.rank,
            world_size=self.world_size,
            config=self.config,
            recorder=self._ledger,
            stats=self._stats,
        )
        self._last_step: int | None = None
        self._cache = ResolveCache()
        self._closed = False
        self._adopted = memory.take(self.root) if self.config.memory_tier else None
        # After an in-process restart: the failed iteration's arena, with its snapshot.
        adopted_arena = self._adopted.arena if self._adopted is not None else None
        self._staging = Staging(rank=self.rank, arena=adopted_arena)
        if self.config.eager_writer:
            self._inflight.start_writer(self._hooks)
        _created.add(self)

    # --- public API --------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any]) -> bool:
        """``save`` when ``step`` is due (after every ``every_steps`` completed steps)."""
        if not self.config.due(step):
            return False
        return self.save(step, state)

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as the checkpoint of ``step`` (completed, 0-based). Returns False
        when the save was skipped. Async: returns once staged; sync: once committed."""
        t0 = time.time()
        self._check()
        if step == self._last_step:
            return False
        if self.config.overlap:
            self._staging.hook(state, self.wait_staged)
        self.wait_staged()
        waited = 0.0
        busy = self._inflight.busy()
        if busy:
            current = self._inflight.current
            assert current is not None
            if self.config.mode == "async" and self.config.on_busy == "skip":
                self._inflight.skip(step, f"the save of step {current.step} is still persisting")
                self._stats.blocking_s += time.time() - t0
                return False
            self._inflight.wait_done()
            waited = time.time() - t0
        writer = self._inflight.start_writer(self._hooks)
        t1 = time.time()
        resolved = resolve_for_save(
            state,
            rank=self.rank,
            world_size=self.world_size,
            overlap=self.config.overlap,
            cache=self._cache,
            stage_all=self.config.memory_tier,
        )
        staging = self._staging
        staging.held = None  # the arena is about to be overwritten
        tensors = [i for i in resolved.items if i.tensor is not None]
        payloads = [(i.write_item, i.payload) for i in resolved.items if i.tensor is None]
        alloc_s = staging.prepare(tensors, writer)
        t2 = time.time()
        now_pairs: Pairs = []
        later_pairs: Pairs = []
        for item, slot in zip(tensors, staging.slots, strict=True):
            assert item.tensor is not None
            (later_pairs if item.background else now_pairs).append((item.tensor, slot))
        staging.copy_now(now_pairs)
        msg = {
            "type": "save",
            "step": step,
            "layout_id": staging.layout_id,
            "payloads": payloads,
            "assigned": resolved.assigned,
            "planner_data": resolved.planner_data,
        }
        inflight = self._inflight.begin(step)
        self._last_step = step
        held = memory.Snapshot(
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            arena=staging.arena,
            tensors=[(i.write_item.index, s) for i, s in zip(tensors, staging.slots, strict=True)],
            payloads=[(wi.index, p) for wi, p in payloads if p is not None],
        )
        if later_pairs:
            staging.copy_later(
                later_pairs,
                held=held,
                done=lambda: self._inflight.send(msg, inflight),
                failed=lambda e: self._inflight.staging_failed(inflight, e),
            )
        else:
            staging.held = held
            self._inflight.send(msg, inflight)
        t3 = time.time()
        nbytes = resolved.tensor_bytes + sum(len(p or b"") for _, p in payloads)
        self._stats.saves += 1
        self._stats.staged_bytes = nbytes
        if self.config.mode == "sync":
            self.wait()
        end = time.time()
        self._stats.stall_s.append(end - t0)
        self._stats.blocking_s += end - t0
        self._ledger.interval(
            ev.CKPT_STAGE,
            begin=t0,
            end=end,
            step=step,
            bytes=nbytes,
            wait_s=waited,
            resolve_s=t2 - t1 - alloc_s,
            alloc_s=alloc_s,
            copy_s=t3 - t2,
            background_bytes=sum(int(t.numel() * t.element_size()) for t, _ in later_pairs),
            mode=self.config.mode,
            staging_bytes=staging.size,
            queue_depth=1 if busy else 0,
            **_memory(),
        )
        return True

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot is fully copied (only ever waits with
        ``overlap``). Call before changing parameters or optimizer state other than through
        ``optimizer.step`` of an optimizer in the state."""
        self._inflight.wait_staged()

    def wait(self) -> None:
        """Block until the in-flight save is committed (on every rank: rank 0 commits, the
        others watch for the commit). Raises CheckpointError when it failed."""
        self._check()
        self.wait_staged()
        inflight = self._inflight.current
        if inflight is None:
            return
        self._inflight.wait_done()
        if self.rank != 0 and inflight.outcome == "persisted":
            self._inflight.wait_commit_on_disk(inflight)
        self._check()

    def close(self) -> None:
        """Wait for the in-flight save to be committed, then stop the writer. Idempotent.
        Interrupted while waiting (a restart interrupt, Ctrl-C): ``abort`` instead."""
        if self._closed:
            return
        try:
            if not self._inflight.fatal:
                self.wait()
        except Exception:
            self._stop()
            raise
        except BaseException:
            self.abort()
            raise
        self._stop()
        fatal = self._inflight.fatal
        if fatal and not self._inflight.fatal_raised:
            self._inflight.fatal_raised = True
            raise CheckpointError(fatal)

    def restore(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest committed checkpoint that passes its checks into ``state``;
        returns its step, or None when there is none. Collective with a process group: call
        it on every rank, at start (it also clears the leftovers of interrupted saves). The
        ledger's next step interval starts when it returns (a restore is no part of a step)."""
        if self._closed:
            raise CheckpointError("restore() on a closed Checkpointer")
        t0 = time.time()
        step, held = self._restore_from_memory(state)
        if step is not None:
            self._ledger.interval(ev.CKPT_LOAD, begin=t0, step=step, tier="memory", path=None)
            self._ledger.mark()
            self._last_step = step
            return step
        result: RestoreResult = _restore(
            state, root=self.root, rank=self.rank, checksums=self.config.verify
        )
        for step, why in result.rejected:
            self._ledger.emit(
                ev.CKPT_FAIL, step=step, error=f"rejected at restore: {why}", phase="load"
            )
        self._ledger.interval(
            ev.CKPT_LOAD,
            begin=t0,
            step=result.step,
            tier="disk" if result.step is not None else "none",
            path=str(result.path) if result.path else None,
            rejected=[s for s, _ in result.rejected],
            skipped=result.skipped,
            memory=held,
        )
        self._ledger.mark()
        self._last_step = result.step
        return result.step

    def resume(self, state: Mapping[str, Any]) -> int:
        """``restore(state)``, then the step to continue from: 0 when there was no checkpoint,
        else the restored step + 1 (``for step in range(ckpt.resume(state), steps)``)."""
        step = self.restore(state)
        return 0 if step is None else step + 1

    def _restore_from_memory(self, state: Mapping[str, Any]) -> tuple[int | None, list[Any]]:
        """The memory tier (see ``memory``): the step restored, or None (then: disk), and the
        step each rank held in memory (None: nothing). Collective with a process group."""
        snap, self._adopted = self._adopted, None
        mine, pending = None, None
        if snap is not None and (snap.rank, snap.world_size) == (self.rank, self.world_size):
            try:  # checked here, applied only if every rank can (one all-gather decides)
                pending = memory.prepare(state, snap, rank=self.rank)
                mine = snap.step
            except memory.Mismatch as e:
                logger.warning("in-memory snapshot of step %d does not fit: %s", snap.step, e)
        held: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized():
            held = [None] * self.world_size
            dist.all_gather_object(held, mine)
        if mine is None or pending is None or any(s != mine for s in held):
            return None, held
        pending.apply()
        if self.rank == 0:  # what the killed writers left, as a disk restore does
            layout.sweep_incomplete(self.root)
        return mine, held

    def latest(self) -> int | None:
        """The newest committed step (its files are not checked), or None."""
        steps = layout.committed_steps(self.root)
        return steps[0] if steps else None

    @property
    def last_committed(self) -> int | None:
        """Newest step this Checkpointer saw committed (rank 0 only: it commits), else None."""
        return self._inflight.last_committed

    def stats(self) -> CheckpointStats:
        """A copy of this Checkpointer's counters."""
        return dataclasses.replace(
            self._stats,
            stall_s=list(self._stats.stall_s),
            persist_s=list(self._stats.persist_s),
            commit_s=list(self._stats.commit_s),
        )

    @property
    def staging_bytes(self) -> int:
        """Bytes of shared staging memory this rank holds for its snapshots (0 before the
        first save)."""
        return self._staging.size

    @property
    def writer_pid(self) -> int | None:
        """Pid of this rank's writer process, or None before it is started."""
        writer = self._inflight.writer
        return writer.pid if writer else None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @masked
    def abort(self) -> None:
        """Stop the writer now, without waiting for the in-flight save (it is lost, never
        half-visible). For error paths; idempotent, and a no-op after ``close``. Masked
        (``unbroken.mask``): a restart interrupt waits for it to complete."""
        if self._closed:
            return
        self._closed = True
        self._inflight.kill_writer()
        try:
            self._shutdown(keep_snapshot=self.config.memory_tier)
        except Exception:  # already unwinding from another error: do not mask it
            logger.exception("stopping the checkpoint writer")

    # --- internals ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        self._inflight.check()

    @masked
    def _stop(self) -> None:
        """``close``'s end, after the wait: closed, the writer stopped, the arena freed."""
        self._closed = True
        self._shutdown()

    def _shutdown(self, *, keep_snapshot: bool = False) -> None:
        """Stop staging and the writer and free the arena; with ``keep_snapshot`` (an abort)
        the arena and its fully staged step go to the memory tier instead."""
        self._staging.stop(keep_for=self.root if keep_snapshot else None)
        self._inflight.close()
        self._staging.close()
