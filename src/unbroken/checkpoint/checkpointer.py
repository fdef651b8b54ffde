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

At most one save is in flight per rank; one that comes while the previous one persists is
skipped or waits for it (``on_busy``). With one snapshot in memory (``memory_slots`` 1, the
default) every save and snapshot is collective: one all-reduce, then all ranks stage or none
(``save``); with a ring, a rank that skips leaves a marker and the coordinator abandons that
step. ``maybe_save`` agrees the snapshot interval at every durable save (collective).
A checkpoint directory must be on storage every rank sees (one machine, or a shared one).
Ownership (``unbroken.ledger.owner``): the Checkpointer claims its directory for its run;
another run's Checkpointer is refused while it runs, and its checkpoints unless ``allow_foreign``.
Storage failures are not training failures (none touches an older committed checkpoint): a
save the writer reports failed (full, read-only, I/O errors), one not durable within
``persist_timeout_s`` (its writer killed), the writer's death (end of its socket) are recorded
(``ckpt_fail``) and never raised into the training step; training goes on with the memory
tier's snapshots, durable saves are retried with back-off, and ``storage`` says how long this
rank has run unprotected (``persisting.health``; ``on_storage_failure`` "stop" ends the job
with ``StorageFailed`` after a limit). Memory-only snapshots (``snapshot``) come between the
durable saves (``snapshot_every``, or as ``snapshot_budget`` allows); with ``memory_keeper``
(set by ``unbroken-run``) they outlive the process. On SIGTERM inside ``unbroken.run``,
``maybe_save`` stops the job gracefully (``preempt``). The environment's overrides win over
the arguments (``config.overridden``). Phases (``unbroken.ledger.phases``): ``restore``,
``save`` (durable), ``persist`` (handed to the writer), ``shutdown`` (``close``, unless the
script named one). The flows, module by module: a save's in ``persisting``'s docstring, a
restore's in ``restoring``'s (``state``, ``staging``, ``persisting``, ``tiers``, ``restoring``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint import layout, node, preempt
from unbroken.checkpoint.config import (
    SETTINGS,
    CheckpointConfig,
    CheckpointError,
    Mode,
    OnBusy,
    merged,
    overridden,
)
from unbroken.checkpoint.persisting.health import StorageStatus
from unbroken.checkpoint.persisting.hooks import WriterHooks, offered
from unbroken.checkpoint.persisting.inflight import CheckpointStats
from unbroken.checkpoint.restoring.restore import restore_recorded
from unbroken.checkpoint.save import Saves
from unbroken.checkpoint.schedule.adaptive import AdaptiveSaves, max_over_ranks
from unbroken.checkpoint.schedule.snapshots import AutoSnapshots
from unbroken.checkpoint.tiers import tiers
from unbroken.ledger import NULL, Recorder, owner, phases
from unbroken.ledger.active import current as active_ledger
from unbroken.mask import masked

__all__ = ["CheckpointStats", "Checkpointer"]

logger = logging.getLogger(__name__)

_created: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def open_checkpointers() -> list[Checkpointer]:
    """This process's Checkpointers not yet closed or aborted (``unbroken.run`` aborts those a
    failed iteration left open, and reports their newest commit in the launcher heartbeat)."""
    return [c for c in _created if not c.closed]


class Checkpointer:
    """Saves and restores a training state under ``directory``; see the module docstring.

    The common settings are keywords; one not given (None) keeps its value in ``config``
    (``CheckpointConfig``: each field's docstring), where the others are set. Rank and world
    size come from the default process group. Under ``unbroken.run``, the node's memory keeper
    and peers fill in ``memory_keeper``, ``peers`` and ``peer_index`` unless given here or set
    in ``config``. Use as a context manager or call ``close()``.

    Args:
        directory: Where the checkpoints are, on storage every rank sees.
        every_steps: ``maybe_save`` saves after every this many completed steps (0: never).
        keep: Committed checkpoints to keep, the newest ones (at least 1).
        mode: "async": ``save`` returns once the state is staged; "sync": once committed.
        on_busy: A save while the previous one persists is dropped ("skip") or waits ("wait").
        overlap: Copy parameters and optimizer state while the next forward/backward runs.
        memory_tier: Keep the newest snapshots in memory, to restore from there.
        snapshot_every: ``maybe_save`` also snapshots to memory after every this many
            completed steps (0: as ``snapshot_budget`` allows); needs ``memory_tier``.
        rescue: With the memory tier, ``note`` the steps not staged (rescued after a fault).
        memory_slots: Snapshots held in memory per rank (``CheckpointConfig.memory_slots``).
        memory_keeper: Address of the node agent's memory keeper ("": none).
        peers: Every node's peer memory service, in node order (empty: no peer tier).
        peer_index: This node's position in ``peers``.
        persist_timeout_s: A save not durable this long after it was staged has failed.
        eager_writer: Start the writer process now (False: at the first save).
        verify: ``restore`` checks every file's checksum before loading.
        allow_foreign: ``restore`` may load a checkpoint another run wrote.
        config: The other settings (None: the defaults).
        ledger: Records every save and load (None: the active ledger of ``unbroken.run``).
        hooks: Hooks for the writer process (``persisting.hooks``; None: ``unbroken.run``'s).
        run: The job that owns the directory (None: the ledger's run; without one, a single
            process is its own job and the ranks of a group share an unnamed one, whose
            checkpoints any run may restore).

    Raises:
        ValueError: When the settings contradict each other (``CheckpointConfig``), or
            another running job holds ``directory`` (``unbroken.ledger.owner.DirectoryOwned``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        keep: int | None = None,
        mode: Mode | None = None,
        on_busy: OnBusy | None = None,
        overlap: bool | None = None,
        memory_tier: bool | None = None,
        snapshot_every: int | None = None,
        rescue: bool | None = None,
        memory_slots: int | None = None,
        memory_keeper: str | None = None,
        peers: Sequence[str] | None = None,
        peer_index: int | None = None,
        persist_timeout_s: float | None = None,
        eager_writer: bool | None = None,
        verify: bool | None = None,
        allow_foreign: bool | None = None,
        config: CheckpointConfig | None = None,
        ledger: Recorder | None = None,
        hooks: WriterHooks | None = None,
        run: str | None = None,
    ) -> None:
        settings = {k: v for k, v in locals().items() if k in SETTINGS}  # the keywords above
        given = merged(config, settings, node.current().fields)
        self.config = overridden(given, node.job().overrides)
        self.root = Path(directory).resolve()
        grouped = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        active = active_ledger() if ledger is None else ledger
        self._ledger: Recorder = NULL if active is None else active
        named = getattr(self._ledger, "run", None)
        self.run: str | None = run or (named if isinstance(named, str) and named else None)
        """The run recorded in (and checked against) the checkpoints' manifests."""
        job = self.run or (
            f"process {socket.gethostname()}:{os.getpid()}" if self.world_size == 1 else "unnamed"
        )
        # Before the writer and the arena exist: nothing of another job's is touched.
        self._claim = owner.claim(self.root, job=job, takeover=True)
        staging, self._adopted_from, self._replica = tiers.staging_for(
            self.root, self.config, rank=self.rank, world_size=self.world_size
        )
        self._adopted = staging.arena if self._adopted_from else None
        self._saves = Saves(
            root=self.root,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            run=self.run,
            ledger=self._ledger,
            hooks=hooks if hooks is not None else offered(self.root),  # the fault plan's
            staging=staging,
        )
        self._adaptive = AdaptiveSaves.of(self.root, self.config, self._ledger, self.rank)
        self._auto = AutoSnapshots.of(self.config, max_over_ranks)
        self._graceful = preempt.Stop(self.root, self.run)
        if self.config.eager_writer:
            self._saves.inflight.start_writer(self._saves.hooks)  # the first: nothing to hand over
        _created.add(self)

    # --- public API --------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any]) -> bool:
        """``save`` when due (after every ``every_steps`` completed steps), else ``snapshot``
        when due (``snapshot_every``/``snapshot_budget``) or held back (one copy), else ``note``.

        Args:
            step: The step just completed (0-based).
            state: Name -> model, optimizer, Stateful or tensor (as ``save`` takes it).

        Returns:
            True when a save or snapshot was staged.

        Raises:
            CheckpointError: When the Checkpointer is closed.
            StorageFailed: ``on_storage_failure="stop"``: storage failed for
                ``storage_failure_limit_s`` and the final save failed too.
            Preempted: This process got SIGTERM inside ``unbroken.run``, and ``step`` is the
                one every rank agreed to stop at: it was saved (and committed, unless storage
                failed) first (``unbroken.checkpoint.preempt``).
        """
        if self._graceful.due(step):
            self._preempted(step, state)
        adaptive, auto = self._adaptive, self._auto
        snap = auto is not None and auto.step(step)  # timed; True: a snapshot is due
        due = self.config.due(step) if adaptive is None else adaptive.due(step, self._saves.stats)
        pending = self._saves.pending  # one copy: a save (True) or snapshot held back a step
        if due or pending:
            t0 = time.time()
            staged = self.save(step, state)
            if self._saves.pending is None:  # staged, not held back: its cost is measured
                if adaptive is not None:
                    adaptive.saved(step, blocking_s=time.time() - t0, stats=self._saves.stats)
                if auto is not None:
                    auto.saved(step, stall_s=time.time() - t0)
            return staged
        if snap or self.config.snapshot_due(step) or pending is not None:
            t0 = time.time()
            staged = self.snapshot(step, state)
            if auto is not None and self._saves.pending is None:  # staged: its stall counts
                auto.snapshotted(step, stall_s=time.time() - t0)
            return staged
        self._saves.prepare_ahead(state)  # once: the plan notes need, a large arena laid out
        self.note(step, state)
        return False

    @masked  # every rank saves and raises Preempted: a peer that raised first interrupts no one
    def _preempted(self, step: int, state: Mapping[str, Any]) -> None:
        t0 = time.time()
        self._saves.save(step, state, durable=True, last=True)
        why = None if self.wait() else str(self.storage.last_error)
        preempt.stopped(step, began=t0, ledger=self._ledger, failed=why, latest=self.latest())

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as the checkpoint of ``step``. Async: returns once staged; sync:
        once committed.

        Args:
            step: The step just completed (0-based).
            state: Name -> model, optimizer, Stateful or tensor: what the checkpoint holds.

        Returns:
            False when the save was skipped (the previous one persists, ``on_busy="skip"``, or
            storage is failing and the next attempt is later: with the memory tier it is still
            snapshotted in memory) or ``step`` was just staged. A save that fails later (async)
            or failed (sync) is recorded, not raised: see ``storage``.

        Raises:
            CheckpointError: When the Checkpointer is closed.
            StorageFailed: ``on_storage_failure="stop"``: storage failed for
                ``storage_failure_limit_s`` and this, the final save, failed too.
        """
        return self._saves.save(step, state, durable=True)

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as ``step`` in memory only (the memory tier; nothing persisted):
        what a restart restores when no newer step is held. Blocks like an async save: only
        for the copy that cannot overlap.

        Args:
            step: The step just completed (0-based).
            state: As for ``save``.

        Returns:
            False when ``step`` was just staged.

        Raises:
            ValueError: Without the memory tier.
            CheckpointError: When the Checkpointer is closed.
        """
        if not self.config.memory_tier:
            raise ValueError("snapshot() needs memory_tier=True (a snapshot is held in memory)")
        return self._saves.save(step, state, durable=False)

    def note(self, step: int, state: Mapping[str, Any]) -> bool:
        """Note completed ``step`` without staging it (memory tier): an ``abort`` unwinding
        from a fault snapshots it from the live state if unchanged (``rescue``).

        Args:
            step: The step just completed (0-based).
            state: As for ``save``.

        Returns:
            True when noted; False without the memory tier or ``rescue``, once closed, or
            when the state cannot be rescued (not resolved yet, a model with buffers).
        """
        return self._saves.note(step, state)

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot is copied and sealed (waits with ``overlap``, or
        for a large one's seal). Call before changing parameters or optimizer state other than
        through ``optimizer.step`` of an optimizer in the state."""
        self._saves.wait_staged()

    def wait(self) -> bool:
        """Block until the in-flight save is committed (on every rank: rank 0 commits, the
        others watch for the commit) or has failed.

        Returns:
            True when the newest save handed to the writer (if any) is durable; False when it
            failed or was abandoned (the failure is recorded and in ``storage``).

        Raises:
            CheckpointError: When the Checkpointer is closed.
        """
        return self._saves.wait()

    def close(self) -> None:
        """Wait for the in-flight save to be committed (or to fail: recorded, not raised),
        then stop the writer. Idempotent. Interrupted while waiting (a restart interrupt,
        Ctrl-C): ``abort`` instead.

        Raises:
            Exception: Whatever waiting raised that is not a failed save (the writer is
                stopped all the same); a failed save is recorded, not raised.
        """
        if self._saves.closed:
            return
        named = "shutdown" in phases.active()
        with contextlib.nullcontext() if named else phases.region("shutdown"):
            self._close()

    def _close(self) -> None:
        try:
            self.wait()
        except Exception:
            self._stop()
            raise
        except BaseException:
            self.abort()
            raise
        self._saves.extras.record_digest(self._ledger, self._saves.last_step)
        self._stop()

    def restore(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest committed checkpoint that passes its checks into ``state``.

        Collective with a process group: call it on every rank, at start (it also clears the
        leftovers of interrupted saves). The ledger's next step interval starts when it
        returns (a restore is no part of a step).

        Args:
            state: As for ``save``; loaded in place.

        Returns:
            The restored step, or None when there is no checkpoint.

        Raises:
            CheckpointError: When the Checkpointer is closed, the storage fails while
                checking, or the newest sound checkpoint does not fit ``state`` (another model)
                or another run wrote it (without ``allow_foreign``).
        """
        if self._saves.closed:
            raise CheckpointError("restore() on a closed Checkpointer")
        with phases.region("restore"):
            return self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> int | None:
        t0, state = time.time(), self._saves.extras.full(state)
        arena, self._adopted = self._adopted, None
        step, held, why = tiers.restore_recorded(
            state,
            arena,
            staging=self._saves.staging,
            root=self.root,
            rank=self.rank,
            world_size=self.world_size,
            source=self._adopted_from,
            ledger=self._ledger,
            begin=t0,
        )
        if step is None:
            self._saves.staging.retain(None)  # what memory held is of another timeline now
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
        self._saves.last_step = step
        return step

    def resume(self, state: Mapping[str, Any]) -> int:
        """``restore(state)``, then the step to continue from
        (``for step in range(ckpt.resume(state), steps)``).

        Args:
            state: As for ``restore``.

        Returns:
            0 when there was no checkpoint, else the restored step + 1.

        Raises:
            CheckpointError: As ``restore``.
        """
        step = self.restore(state)
        return 0 if step is None else step + 1

    def latest(self) -> int | None:
        """The newest committed step on disk.

        Returns:
            Its step (its files are not checked), or None when there is none.
        """
        return next(iter(layout.committed_steps(self.root)), None)

    @property
    def last_committed(self) -> int | None:
        """Newest step this Checkpointer saw committed (rank 0 only: it commits), else None."""
        return self._saves.inflight.last_committed

    def stats(self) -> CheckpointStats:
        """This Checkpointer's counters.

        Returns:
            A copy that later saves do not change.
        """
        return self._saves.stats.copy()

    @property
    def storage(self) -> StorageStatus:
        """This rank's checkpoint storage as its saves saw it: failing since when, how many
        saves failed, the last error, how long this rank ran unprotected by a durable save."""
        return self._saves.inflight.health.status()

    @property
    def closed(self) -> bool:
        """True once closed or aborted."""
        return self._saves.closed

    @property
    def staging_bytes(self) -> int:
        """Bytes of shared staging memory this rank holds for its snapshots (0: none yet)."""
        return self._saves.staging.size

    @property
    def writer_pid(self) -> int | None:
        """Pid of this rank's writer process, or None before it is started."""
        return self._saves.inflight.writer.pid if self._saves.inflight.writer else None

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
        if self._saves.closed:
            return
        self._saves.rescue()  # the noted step, if unchanged
        self._saves.closed = True
        self._saves.inflight.kill_writer()
        try:
            self._shutdown(keep_snapshot=self.config.memory_tier)
        except Exception:  # already unwinding from another error: do not mask it
            logger.exception("stopping the checkpoint writer")

    # --- internals ---------------------------------------------------------------------------
    @masked
    def _stop(self) -> None:
        """``close``'s end, after the wait: closed, the writer stopped, the arena freed."""
        self._saves.closed = True
        self._shutdown()

    def _shutdown(self, *, keep_snapshot: bool = False) -> None:
        """Stop staging and the writer and free the arena; with ``keep_snapshot`` (an abort)
        the arena and its fully staged step go to the memory tier instead."""
        try:
            if self._replica is not None:
                self._replica.close()
            self._saves.staging.stop(keep_for=self.root if keep_snapshot else None)
            self._saves.inflight.close()
            self._saves.staging.close()
        finally:
            self._claim.release()
