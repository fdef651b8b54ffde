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
Ownership (``unbroken.ledger.owner``): the Checkpointer claims its directory for its run;
another run's Checkpointer is refused while it runs, and its checkpoints unless ``allow_foreign``.
Failures (none touches an older committed checkpoint): the writer's death (end of its
socket), a save not durable within ``persist_timeout_s`` (its writer killed) or one the writer
reports failed is recorded (``ckpt_fail``) and raised once, as ``CheckpointError``, by the
next call. ``snapshot_every`` stages memory-only snapshots (``snapshot``) between the durable
saves of ``every_steps``; with ``memory_keeper`` (set by ``unbroken-run``) they outlive the
process.

The environment's overrides win over the arguments (``config.overridden``). Phases
(``unbroken.ledger.phases``): ``restore``, ``save`` (durable), ``persist`` (handed to the
writer), ``shutdown`` (``close``, unless the script named one already).

The flows, module by module: a save's in ``persisting``'s docstring, a restore's in
``restoring``'s (the phases: ``state``, ``staging``, ``persisting``, ``tiers``, ``restoring``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint import layout, node
from unbroken.checkpoint.config import CheckpointConfig, CheckpointError, overridden
from unbroken.checkpoint.persisting.hooks import WriterHooks, offered
from unbroken.checkpoint.persisting.inflight import CheckpointStats, Inflight
from unbroken.checkpoint.restoring.restore import restore_recorded
from unbroken.checkpoint.schedule.adaptive import AdaptiveSaves
from unbroken.checkpoint.staging import rescue
from unbroken.checkpoint.staging.staging import fill, process_memory
from unbroken.checkpoint.state.extras import StateExtras
from unbroken.checkpoint.state.resolve import ResolveCache, plan_args, resolve_for_save
from unbroken.checkpoint.tiers import tiers
from unbroken.ledger import NULL, Recorder, owner, phases
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


def _log_failed(step: int, e: Exception) -> None:
    logger.warning("snapshot of step %d not kept in memory: %s", step, e)


class Checkpointer:
    """Saves and restores a training state under ``directory``; see the module docstring.

    ``fields`` override ``config`` (CheckpointConfig): ``every_steps``, ``keep``, ``mode``,
    ``on_busy``, ``overlap``, ... Rank and world size come from the default process group.
    ``run`` names the job that owns the directory (None: the ledger's run; without one, a
    single process is its own job and the ranks of a group share an unnamed one, whose
    checkpoints any run may restore). ``ledger`` records every save and load (None: the
    active ledger of ``unbroken.run``). Without ``config``, the memory keeper and peers that
    ``unbroken.run`` offers are filled in unless given (``node``). ``hooks`` go to the writer
    process (``unbroken.checkpoint.persisting.hooks``; None: those ``unbroken.run`` offers, if any).
    Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ledger: Recorder | None = None,
        hooks: WriterHooks | None = None,
        config: CheckpointConfig | None = None,
        run: str | None = None,
        **fields: Any,
    ) -> None:
        if config is None:  # the node's memory keeper and peers, under ``unbroken.run``
            fields = {**node.current().fields(fields), **fields}
        given = dataclasses.replace(config or CheckpointConfig(), **fields)
        self.config = overridden(given, node.job().overrides)
        self.root = Path(directory).resolve()
        self.rank, self.world_size = _world()
        active = active_ledger() if ledger is None else ledger
        self._ledger: Recorder = NULL if active is None else active
        named = getattr(self._ledger, "run", None)
        self.run: str | None = run or (named if isinstance(named, str) and named else None)
        """The run recorded in (and checked against) the checkpoints' manifests."""
        job = self.run or (
            f"process {socket.gethostname()}:{os.getpid()}" if self.world_size == 1 else "unnamed"
        )
        self._hooks = hooks if hooks is not None else offered(self.root)  # the fault plan's
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
        self._notes = rescue.Notes()
        self._extras = StateExtras(self.config)  # the generators; the state for the digest
        self._closed = False
        # Before the writer and the arena exist: nothing of another job's is touched.
        self._claim = owner.claim(self.root, job=job, takeover=True)
        self._staging, self._adopted_from, self._replica = tiers.staging_for(
            self.root, self.config, rank=self.rank
        )
        self._adopted = self._staging.arena if self._adopted_from else None
        self._persisting_region: int | None = None
        self._adaptive = AdaptiveSaves.of(self.root, self.config, self._ledger, self.rank)
        if self.config.eager_writer:
            self._inflight.start_writer(self._hooks)
        _created.add(self)

    # --- public API --------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any]) -> bool:
        """``save`` when ``step`` is due (after every ``every_steps`` completed steps), else
        ``snapshot`` when a snapshot is due (``snapshot_every``); True when either staged."""
        adaptive = self._adaptive
        if self.config.due(step) if adaptive is None else adaptive.due(step, self._stats):
            t0 = time.time()
            staged = self.save(step, state)
            if adaptive is not None:
                adaptive.saved(step, blocking_s=time.time() - t0, stats=self._stats)
            return staged
        if self.config.snapshot_due(step):
            return self.snapshot(step, state)
        self.note(step, state)
        return False

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as the checkpoint of ``step`` (completed, 0-based). Returns False
        when the save was skipped (with the memory tier it is still snapshotted in memory).
        Async: returns once staged; sync: once committed."""
        return self._stage(step, state, durable=True)

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as ``step`` in memory only (the memory tier; nothing persisted):
        what a restart restores when no newer step is held. Returns False when ``step`` was
        just staged. Blocks like an async save: only for the copy that cannot overlap."""
        if not self.config.memory_tier:
            raise ValueError("snapshot() needs memory_tier=True (a snapshot is held in memory)")
        return self._stage(step, state, durable=False)

    def note(self, step: int, state: Mapping[str, Any]) -> bool:
        """Note completed ``step`` without staging it (memory tier): an ``abort`` unwinding
        from a fault snapshots it from the live state if unchanged (``rescue``)."""
        if not (self.config.memory_tier and self.config.rescue) or self._closed:
            return False
        t0, o, w = time.time(), self.config.overlap, self.world_size
        state = self._extras.full(state)
        args = plan_args(state, rank=self.rank, world_size=w, overlap=o, stage_all=True)
        if not self._notes.take(step, state, self._cache.plan, args):
            return False  # refused at once (before the first save, a model with buffers)
        self._blocked(t0, step, "note")
        return True

    def _stage(self, step: int, state: Mapping[str, Any], *, durable: bool) -> bool:
        with phases.region("save") if durable else contextlib.nullcontext():
            return self._stage_now(step, state, durable=durable)

    def _stage_now(self, step: int, state: Mapping[str, Any], *, durable: bool) -> bool:
        t0, state = time.time(), self._extras.full(state)
        self._check()
        if step == self._last_step:
            return False
        if self.config.overlap:
            self._staging.hook(state, self.wait_staged)
        self.wait_staged()
        waited = 0.0
        busy = self._inflight.busy()
        skipped = False
        if busy and durable:
            current = self._inflight.current
            assert current is not None
            if self.config.mode == "async" and self.config.on_busy == "skip":
                self._inflight.skip(step, f"the save of step {current.step} is still persisting")
                if not self.config.memory_tier:
                    self._stats.blocking_s += time.time() - t0
                    return False
                durable, skipped = False, True  # still a snapshot in memory
            else:
                with node.waiting():
                    self._inflight.wait_done()
                waited = time.time() - t0
                busy = False
        writer = self._inflight.start_writer(self._hooks)
        t1 = time.time()
        resolved = resolve_for_save(
            state,
            rank=self.rank,
            world_size=self.world_size,
            overlap=self.config.overlap,
            cache=self._cache,
            stage_all=self.config.memory_tier,
            defer=not durable and self.config.overlap,  # torch.save on the stager thread
        )
        staging = self._staging
        tensors = [i for i in resolved.items if i.tensor is not None]
        values = [i for i in resolved.items if i.tensor is None]
        alloc_s = staging.prepare(tensors, sum(i.nbytes for i in values), writer)
        t2 = time.time()
        region, _ = staging.begin(pinned=self._persisting_region if busy else None)
        now_src, now_dst, later_src, later_dst = staging.split(region, tensors)
        staging.copy_now(now_src, now_dst)
        self._last_step = step
        held = staging.snapshot(step, region, world_size=self.world_size)
        sealing = self.config.memory_tier
        if durable:
            msg = {
                "type": "save",
                "step": step,
                "layout_id": staging.layout_id,
                "base": staging.data_base(region),
                "payloads": [(i.write_item, i.payload) for i in values],
                "assigned": resolved.assigned,
                "planner_data": resolved.planner_data,
                "run": self.run,
            }
            inflight = self._inflight.begin(step)
            self._persisting_region = region
            done: Callable[[], None] = functools.partial(self._inflight.send, msg, inflight)
            failed: Callable[[Exception], None] = functools.partial(
                self._inflight.staging_failed, inflight
            )
        else:
            done, failed = (lambda: None), functools.partial(_log_failed, step)
        if later_src or (sealing and self.config.overlap):
            staging.copy_later(
                later_src,
                later_dst,
                held=held,
                payloads=values,
                seal=sealing,
                done=done,
                failed=failed,
            )
        else:
            try:
                fill(held, values)
                if sealing:
                    staging.seal_now(held)
            except ValueError as e:
                failed(e)
            else:
                done()
        t3 = time.time()
        nbytes = sum(i.nbytes for i in resolved.items)
        self._stats.staged_bytes = nbytes
        if durable:
            self._stats.saves += 1
            phases.entered("persist")  # handed to the writer (or on its way to it)
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
            background_bytes=sum(i.nbytes for i in tensors if i.background),
            mode=self.config.mode,
            durable=durable,
            region=region,
            staging_bytes=staging.size,
            queue_depth=1 if busy else 0,
            **(process_memory() if durable else {}),  # /proc: 0.1 ms, once per durable save
        )
        return not skipped

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot is fully copied (only ever waits with
        ``overlap``). Call before changing parameters or optimizer state other than through
        ``optimizer.step`` of an optimizer in the state."""
        if self._staging.copying:
            t0 = time.time()
            self._staging.wait()
            end = self._blocked(t0, self._last_step, "overlap")
            if self._stats.stall_s:
                self._stats.stall_s[-1] += end - t0
        self._inflight.wait_staged()

    def wait(self) -> None:
        """Block until the in-flight save is committed (on every rank: rank 0 commits, the
        others watch for the commit). Raises CheckpointError when it failed."""
        self._check()
        self.wait_staged()
        inflight = self._inflight.current
        if inflight is None:
            return
        with node.waiting():  # no progress, for a known reason (``node``)
            self._inflight.wait_done()
            if self.rank != 0 and inflight.outcome == "persisted":
                self._inflight.wait_commit_on_disk(inflight)
        self._check()

    def close(self) -> None:
        """Wait for the in-flight save to be committed, then stop the writer. Idempotent.
        Interrupted while waiting (a restart interrupt, Ctrl-C): ``abort`` instead."""
        if self._closed:
            return
        named = "shutdown" in phases.active()
        with contextlib.nullcontext() if named else phases.region("shutdown"):
            self._close()

    def _close(self) -> None:
        try:
            if not self._inflight.fatal:
                self.wait()
        except Exception:
            self._stop()
            raise
        except BaseException:
            self.abort()
            raise
        self._extras.record_digest(self._ledger, self._last_step)
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
        with phases.region("restore"):
            return self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> int | None:
        t0, state = time.time(), self._extras.full(state)
        arena, self._adopted = self._adopted, None
        step, held, why = tiers.restore_recorded(
            state,
            arena,
            staging=self._staging,
            root=self.root,
            rank=self.rank,
            world_size=self.world_size,
            source=self._adopted_from,
            ledger=self._ledger,
            begin=t0,
        )
        if step is None:
            self._staging.retain(None)  # what memory held is of another timeline now
            step = restore_recorded(
                state,
                root=self.root,
                rank=self.rank,
                config=self.config,
                run=self.run,
                ledger=self._ledger,
                begin=t0,
                memory=held,
                why=why,
            )
        self._last_step = step
        return step

    def resume(self, state: Mapping[str, Any]) -> int:
        """``restore(state)``, then the step to continue from: 0 when there was no checkpoint,
        else the restored step + 1 (``for step in range(ckpt.resume(state), steps)``)."""
        step = self.restore(state)
        return 0 if step is None else step + 1

    def latest(self) -> int | None:
        """The newest committed step (its files are not checked), or None."""
        return next(iter(layout.committed_steps(self.root)), None)

    @property
    def last_committed(self) -> int | None:
        """Newest step this Checkpointer saw committed (rank 0 only: it commits), else None."""
        return self._inflight.last_committed

    def stats(self) -> CheckpointStats:
        """A copy of this Checkpointer's counters."""
        return self._stats.copy()

    @property
    def staging_bytes(self) -> int:
        """Bytes of shared staging memory this rank holds for its snapshots (0: none yet)."""
        return self._staging.size

    @property
    def writer_pid(self) -> int | None:
        """Pid of this rank's writer process, or None before it is started."""
        return self._inflight.writer.pid if self._inflight.writer else None

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
        if self.config.memory_tier and self.config.rescue:  # the noted step, if unchanged
            self._notes.rescue(self._last_step, self._cache.plan, self._stage, self._staging.wait)
        self._closed = True
        self._inflight.kill_writer()
        try:
            self._shutdown(keep_snapshot=self.config.memory_tier)
        except Exception:  # already unwinding from another error: do not mask it
            logger.exception("stopping the checkpoint writer")

    # --- internals ---------------------------------------------------------------------------
    def _blocked(self, t0: float, step: int | None, part: str) -> float:
        """Record ``[t0, now]`` as the trainer blocked by ``part`` of a save; returns now."""
        end = time.time()
        self._stats.blocking_s += end - t0
        self._ledger.interval(ev.CKPT_STAGE, begin=t0, end=end, step=step, part=part)
        return end

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
        try:
            if self._replica is not None:
                self._replica.close()
            self._staging.stop(keep_for=self.root if keep_snapshot else None)
            self._inflight.close()
            self._staging.close()
        finally:
            self._claim.release()
