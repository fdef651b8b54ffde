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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint import layout, memory
from unbroken.checkpoint.arena import Arena, Slot, copy_into, plan_slots
from unbroken.checkpoint.client import WriterClient
from unbroken.checkpoint.config import CheckpointConfig, CheckpointError
from unbroken.checkpoint.resolve import ResolveCache, resolve_for_save
from unbroken.checkpoint.restore import RestoreResult
from unbroken.checkpoint.restore import restore as _restore
from unbroken.ledger import events as ev
from unbroken.ledger.active import current as active_ledger

logger = logging.getLogger(__name__)

_POLL_S = 0.005


@dataclass
class CheckpointStats:
    """Counters of one Checkpointer (read them with ``Checkpointer.stats()``)."""

    saves: int = 0
    """Saves staged and handed to the writer."""
    skipped: int = 0
    """Saves dropped because the previous one was persisting, or abandoned by the coordinator."""
    committed: int = 0
    """Saves this rank saw committed (rank 0), or persisted (other ranks)."""
    failed: int = 0
    stall_s: list[float] = field(default_factory=list)
    """Per save: time the trainer was blocked (waiting, staging, waiting for overlap)."""
    persist_s: list[float] = field(default_factory=list)
    """Per save: the writer's time to write and fsync this rank's data."""
    commit_s: list[float] = field(default_factory=list)
    """Per save (rank 0): from this rank's data durable to the checkpoint committed."""
    blocking_s: float = 0.0
    """All time the trainer spent blocked in this Checkpointer's save path."""
    staged_bytes: int = 0
    """Bytes of the last save."""


@dataclass
class _Inflight:
    step: int
    staged: threading.Event
    sent_ts: float | None = None
    outcome: str | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.outcome is not None


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_created: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def open_checkpointers() -> list[Checkpointer]:
    """This process's Checkpointers not yet closed or aborted (``unbroken.run`` aborts those a
    failed iteration left open, and reports their newest commit in the launcher heartbeat)."""
    return [c for c in _created if not c._closed]


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
    default process group when one is initialized. Records go to ``ledger``, by default the
    active one (``unbroken.run``'s). Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ledger: Any = None,
        config: CheckpointConfig | None = None,
        **fields: Any,
    ) -> None:
        self.config = dataclasses.replace(config or CheckpointConfig(), **fields)
        self.root = Path(directory).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size = _world()
        self._ledger = ledger if ledger is not None else active_ledger()
        self._cond = threading.Condition()
        self._writer: WriterClient | None = None
        self._arena = Arena()
        self._arena_sent = 0
        self._layout_sig: tuple[Any, ...] | None = None
        self._layout_id = 0
        self._slots: list[Slot] = []
        self._inflight: _Inflight | None = None
        self._last_step: int | None = None
        self.last_committed: int | None = None
        """Newest step this Checkpointer saw committed (rank 0 only: it commits), else None."""
        self._fatal: str | None = None
        self._fatal_raised = False
        self._errors: list[str] = []
        self._stager: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._hooked: dict[int, Any] = {}
        self._stats = CheckpointStats()
        self._cache = ResolveCache()
        self._closed = False
        self._held: memory.Snapshot | None = None
        """What the arena holds fully staged (the memory tier), or None mid-copy."""
        self._writer_has_arena = False
        self._adopted = memory.take(self.root) if self.config.memory_tier else None
        if self._adopted is not None:  # an in-process restart: its arena, with a snapshot
            self._arena = self._adopted.arena
        if self.config.eager_writer:
            self._start_writer()
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
        self._hook(state)
        self.wait_staged()
        waited = 0.0
        busy = self._inflight is not None and not self._inflight.done
        if busy:
            assert self._inflight is not None
            if self.config.mode == "async" and self.config.on_busy == "skip":
                self._skip(step, f"the save of step {self._inflight.step} is still persisting")
                self._stats.blocking_s += time.time() - t0
                return False
            self._wait_inflight()
            waited = time.time() - t0
        self._start_writer()
        t1 = time.time()
        resolved = resolve_for_save(
            state,
            rank=self.rank,
            world_size=self.world_size,
            overlap=self.config.overlap,
            cache=self._cache,
            stage_all=self.config.memory_tier,
        )
        self._held = None  # the arena is about to be overwritten
        tensors = [i for i in resolved.items if i.tensor is not None]
        payloads = [(i.write_item, i.payload) for i in resolved.items if i.tensor is None]
        alloc_s = self._prepare(tensors)
        t2 = time.time()
        now_pairs: list[tuple[torch.Tensor, Slot]] = []
        later_pairs: list[tuple[torch.Tensor, Slot]] = []
        for item, slot in zip(tensors, self._slots, strict=True):
            assert item.tensor is not None
            (later_pairs if item.background else now_pairs).append((item.tensor, slot))
        copy_into(self._arena, now_pairs)
        msg = {
            "type": "save",
            "step": step,
            "layout_id": self._layout_id,
            "payloads": payloads,
            "assigned": resolved.assigned,
            "planner_data": resolved.planner_data,
        }
        inflight = _Inflight(step=step, staged=threading.Event())
        with self._cond:
            self._inflight = inflight
        self._last_step = step
        held = memory.Snapshot(
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            arena=self._arena,
            tensors=[(i.write_item.index, s) for i, s in zip(tensors, self._slots, strict=True)],
            payloads=[(wi.index, p) for wi, p in payloads if p is not None],
        )
        if later_pairs:
            self._ensure_stager()
            self._jobs.put((later_pairs, msg, inflight, held))
        else:
            self._held = held
            self._send_save(msg, inflight)
        t3 = time.time()
        nbytes = resolved.tensor_bytes + sum(len(p or b"") for _, p in payloads)
        self._stats.saves += 1
        self._stats.staged_bytes = nbytes
        if self.config.mode == "sync":
            self.wait()
        end = time.time()
        self._stats.stall_s.append(end - t0)
        self._stats.blocking_s += end - t0
        self._interval(
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
            staging_bytes=self._arena.size,
            queue_depth=1 if busy else 0,
            **_memory(),
        )
        return True

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot is fully copied (only ever waits with
        ``overlap``). Call before changing parameters or optimizer state other than through
        ``optimizer.step`` of an optimizer in the state."""
        inflight = self._inflight
        if inflight is None or inflight.staged.is_set():
            return
        t0 = time.time()
        while not inflight.staged.wait(0.1):
            if self._fatal:
                break
        end = time.time()
        if self._stats.stall_s:
            self._stats.stall_s[-1] += end - t0
        self._stats.blocking_s += end - t0
        self._interval(ev.CKPT_STAGE, begin=t0, end=end, step=inflight.step, part="overlap")

    def wait(self) -> None:
        """Block until the in-flight save is committed (on every rank: rank 0 commits, the
        others watch for the commit). Raises CheckpointError when it failed."""
        self._check()
        self.wait_staged()
        inflight = self._inflight
        if inflight is None:
            return
        self._wait_inflight()
        if self.rank != 0 and inflight.outcome == "persisted":
            self._wait_commit_on_disk(inflight)
        self._check()

    def close(self) -> None:
        """Wait for the in-flight save to be committed, then stop the writer. Idempotent."""
        if self._closed:
            return
        try:
            if not self._fatal:
                self.wait()
        finally:
            self._closed = True
            self._shutdown()
        if self._fatal and not self._fatal_raised:
            self._fatal_raised = True
            raise CheckpointError(self._fatal)

    def restore(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest committed checkpoint that passes its checks into ``state``;
        returns its step, or None when there is none. Collective with a process group: call
        it on every rank, at start (it also clears the leftovers of interrupted saves). The
        ledger's next step interval starts when it returns."""
        if self._closed:
            raise CheckpointError("restore() on a closed Checkpointer")
        t0 = time.time()
        step, held = self._restore_from_memory(state)
        if step is not None:
            self._interval(ev.CKPT_LOAD, begin=t0, step=step, tier="memory", path=None)
            self._mark_steps()
            self._last_step = step
            return step
        result: RestoreResult = _restore(
            state, root=self.root, rank=self.rank, checksums=self.config.verify
        )
        for step, why in result.rejected:
            self._emit(ev.CKPT_FAIL, step=step, error=f"rejected at restore: {why}", phase="load")
        self._interval(
            ev.CKPT_LOAD,
            begin=t0,
            step=result.step,
            tier="disk" if result.step is not None else "none",
            path=str(result.path) if result.path else None,
            rejected=[s for s, _ in result.rejected],
            skipped=result.skipped,
            memory=held,
        )
        self._mark_steps()
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

    def stats(self) -> CheckpointStats:
        """A copy of this Checkpointer's counters."""
        return dataclasses.replace(
            self._stats,
            stall_s=list(self._stats.stall_s),
            persist_s=list(self._stats.persist_s),
            commit_s=list(self._stats.commit_s),
        )

    @property
    def writer_pid(self) -> int | None:
        return self._writer.pid if self._writer else None

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

    def abort(self) -> None:
        """Stop the writer now, without waiting for the in-flight save (it is lost, never
        half-visible). For error paths; idempotent, and a no-op after ``close``."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.kill_nowait()
        try:
            self._shutdown(keep_snapshot=self.config.memory_tier)
        except Exception:  # already unwinding from another error: do not mask it
            logger.exception("stopping the checkpoint writer")

    # --- staging -----------------------------------------------------------------------------
    def _prepare(self, tensors: list[Any]) -> float:
        """Lay out the arena for these items (cached while shapes stay), grow it if needed,
        and hand the writer a new layout or arena; returns allocation seconds."""
        assert self._writer is not None
        sig = tuple(
            (i.write_item.index.fqn, tuple(i.write_item.index.offset or ()), i.tensor.dtype,
             tuple(i.tensor.shape))
            for i in tensors
        )  # fmt: skip
        t0 = time.time()
        if sig != self._layout_sig:
            specs = [
                (i.tensor.dtype, tuple(i.tensor.shape), i.tensor.numel() * i.tensor.element_size())
                for i in tensors
            ]
            self._slots, total = plan_slots(specs)
            pin = any(i.tensor.is_cuda for i in tensors)
            if self._arena.ensure(total, pin=pin) or not self._writer_has_arena:
                self._writer.send(
                    {"type": "arena", "size": self._arena.size}, fds=(self._arena.fd,)
                )
                self._writer_has_arena = True
            self._layout_id += 1
            entries = [
                (i.write_item, s) for i, s in zip(tensors, self._slots, strict=True) if i.persist
            ]
            self._writer.send({"type": "layout", "layout_id": self._layout_id, "entries": entries})
            self._layout_sig = sig
        return time.time() - t0

    def _send_save(self, msg: dict[str, Any], inflight: _Inflight) -> None:
        assert self._writer is not None
        msg["sent_ts"] = time.time()
        inflight.sent_ts = msg["sent_ts"]
        try:
            self._writer.send(msg)
        finally:
            inflight.staged.set()

    def _ensure_stager(self) -> None:
        if self._stager is None:
            self._stager = threading.Thread(
                target=self._stage_loop, name=f"unbroken-ckpt-stager-{self.rank}", daemon=True
            )
            self._stager.start()

    def _stage_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, msg, inflight, held = job
            try:
                copy_into(self._arena, pairs)
                self._held = held
                self._send_save(msg, inflight)
            except Exception as e:
                logger.exception("background staging of step %d failed", inflight.step)
                self._finish(inflight, "failed", f"staging failed: {type(e).__name__}: {e}")
                inflight.staged.set()

    def _hook(self, state: Mapping[str, Any]) -> None:
        if not self.config.overlap:
            return
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._hooked:
                self._hooked[id(value)] = value.register_step_pre_hook(
                    lambda _opt, _args, _kwargs: self.wait_staged()
                )

    # --- the writer and its messages ---------------------------------------------------------
    def _start_writer(self) -> None:
        if self._writer is not None:
            return
        self._writer = WriterClient(
            root=self.root,
            rank=self.rank,
            world_size=self.world_size,
            keep=self.config.keep,
            commit_timeout_s=self.config.persist_timeout_s,
            throttle_bytes_per_s=self.config.throttle_mbps * 1e6,
            nice=self.config.writer_nice,
            start=self.config.writer_start,
            on_message=self._on_message,
            on_death=self._on_death,
        )

    def _on_message(self, msg: dict[str, Any]) -> None:
        """From the reader thread."""
        kind, step = msg["type"], msg["step"]
        inflight = self._inflight
        if inflight is None or inflight.step != step:
            logger.warning("checkpoint writer reported %s for step %s, not in flight", kind, step)
            return
        if kind == "persisted":
            self._stats.persist_s.append(msg["end"] - msg["begin"])
            self._interval(
                ev.CKPT_PERSIST,
                begin=msg["begin"],
                end=msg["end"],
                step=step,
                bytes=msg["bytes"],
                write_s=msg["write_s"],
                fsync_s=msg["fsync_s"],
                writer_rss_bytes=msg["rss_bytes"],
            )
            if self.rank != 0:
                self._stats.committed += 1
                self._finish(inflight, "persisted")
        elif kind == "committed":
            self._stats.commit_s.append(msg["end"] - msg["begin"])
            self._stats.committed += 1
            self._emit(
                ev.CKPT_COMMIT,
                ts=msg["end"],
                step=step,
                commit_s=msg["end"] - msg["begin"],
                path=msg["path"],
                removed=msg["removed"],
            )
            self.last_committed = step
            self._finish(inflight, "committed")
        elif kind == "abandoned":
            self._stats.skipped += 1
            self._emit(ev.CKPT_SKIP, step=step, reason=f"abandoned: {msg['reason']}")
            self._finish(inflight, "abandoned")
        elif kind == "failed":
            self._stats.failed += 1
            self._emit(ev.CKPT_FAIL, step=step, error=msg["error"])
            with self._cond:
                self._errors.append(f"checkpoint of step {step} failed: {msg['error']}")
            self._finish(inflight, "failed", msg["error"])

    def _on_death(self, reason: str) -> None:
        """From the reader thread, the moment the writer's socket closes."""
        inflight = self._inflight
        step = inflight.step if inflight and not inflight.done else None
        lost = f"; the save of step {step} is lost" if step is not None else ""
        self._fail(f"{reason}{lost}; the newest committed checkpoint is {self.latest()}", step)

    def _fail(self, message: str, step: int | None) -> None:
        with self._cond:
            if self._fatal:
                return
            self._fatal = message
            self._cond.notify_all()
        logger.error("%s", message)
        self._emit(ev.CKPT_FAIL, step=step, error=message)
        inflight = self._inflight
        if inflight is not None and not inflight.done:
            self._finish(inflight, "failed", message)

    def _finish(self, inflight: _Inflight, outcome: str, error: str | None = None) -> None:
        with self._cond:
            if inflight.outcome is None:
                inflight.outcome, inflight.error = outcome, error
            self._cond.notify_all()

    # --- waiting and checks ------------------------------------------------------------------
    def _deadline_passed(self, inflight: _Inflight) -> bool:
        writer = self._writer
        if inflight.done or inflight.sent_ts is None or writer is None:
            return False
        now = time.time()
        if writer.ready_ts is None:
            if now - writer.spawn_ts <= self.config.writer_start_timeout_s:
                return False
            self._fail(
                f"checkpoint writer process {writer.pid} not ready after "
                f"{self.config.writer_start_timeout_s:.0f} s (writer_start_timeout_s)",
                inflight.step,
            )
            writer.kill_nowait()
            return True
        if now - max(inflight.sent_ts, writer.ready_ts) <= self.config.persist_timeout_s:
            return False
        self._fail(
            f"the save of step {inflight.step} was not durable after "
            f"{self.config.persist_timeout_s:.1f} s (persist_timeout_s): storage stalled? "
            f"Its writer was killed; the newest committed checkpoint is {self.latest()}",
            inflight.step,
        )
        if self._writer is not None:
            self._writer.kill_nowait()
        return True

    def _wait_inflight(self) -> None:
        inflight = self._inflight
        if inflight is None:
            return
        with self._cond:
            while not inflight.done and not self._fatal:
                self._cond.wait(0.1)
                if self._deadline_passed(inflight):
                    break
        self._check()

    def _wait_commit_on_disk(self, inflight: _Inflight) -> None:
        from unbroken.checkpoint.commit import abandon_reason

        marker = layout.step_dir(self.root, inflight.step) / layout.COMMITTED
        part = layout.partial_dir(self.root, inflight.step)
        deadline = time.time() + self.config.persist_timeout_s
        while not marker.exists():
            why = abandon_reason(part) if part.exists() else None
            if why and not marker.exists():
                self._emit(ev.CKPT_SKIP, step=inflight.step, reason=f"abandoned: {why}")
                return
            if time.time() > deadline:
                self._fail(
                    f"step {inflight.step} was not committed by rank 0 within "
                    f"{self.config.persist_timeout_s:.1f} s; is rank 0 alive?",
                    inflight.step,
                )
                break
            time.sleep(_POLL_S)
        self._check()

    def _check(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        inflight = self._inflight
        if inflight is not None:
            self._deadline_passed(inflight)
        if self._fatal:
            self._fatal_raised = True
            raise CheckpointError(self._fatal)
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            raise CheckpointError("; ".join(errors))

    def _skip(self, step: int, reason: str) -> None:
        self._stats.skipped += 1
        if self.world_size > 1:  # tell the coordinator not to wait for this rank
            layout.write_marker(
                layout.partial_dir(self.root, step) / layout.skip_marker(self.rank),
                {"reason": reason},
            )
        self._emit(ev.CKPT_SKIP, step=step, reason=reason)

    # --- teardown and ledger -----------------------------------------------------------------
    def _shutdown(self, *, keep_snapshot: bool = False) -> None:
        """Stop staging and the writer and free the arena; with ``keep_snapshot`` (an abort)
        the arena and its fully staged step go to the memory tier instead."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self._stager is not None:  # a background copy ends before the arena is kept
            self._jobs.put(None)
            self._stager.join(timeout=30.0)
            self._stager = None
        if keep_snapshot and self._held is not None:
            memory.keep(self.root, self._held)  # for the next iteration's restore
            self._arena = Arena()
        if self._writer is not None:
            self._writer.close()
        self._arena.close()

    def _emit(self, kind: str, **data: Any) -> None:
        if self._ledger is not None:
            self._ledger.emit(kind, **data)

    def _interval(self, kind: str, *, begin: float, end: float | None = None, **data: Any) -> None:
        if self._ledger is not None:
            self._ledger.interval(kind, begin=begin, end=end, **data)

    def _mark_steps(self) -> None:
        """A restore is no part of a step: the ledger's next step interval starts after it."""
        if self._ledger is not None:
            self._ledger.mark()
