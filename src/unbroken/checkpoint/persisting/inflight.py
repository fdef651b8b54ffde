"""In-flight bookkeeping: the one save a rank has in flight, its writer, and how it ends.

``Inflight`` starts the rank's writer process, hands it each staged save, hears back from it
(on the writer client's reader thread) and records what happened (``ckpt_persist``,
``ckpt_commit``, ``ckpt_skip``, ``ckpt_fail``); the training thread waits on it and asks it for
errors. A failed save is a storage failure (``health``), never an exception in the training
step: the writer reports it failed (full, read-only, I/O errors), or it is not durable within
``persist_timeout_s`` (counted from the later of staging and the writer being ready: the
writer is killed), or the writer dies (noticed the moment its socket closes) or never becomes
ready. Each is recorded (``ckpt_fail``, ``stats.failed``) and backs the next durable save off;
a writer that was killed or died is replaced at the next save.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from unbroken.checkpoint import layout
from unbroken.checkpoint.config import CheckpointConfig, CheckpointError
from unbroken.checkpoint.persisting.client import WriterClient
from unbroken.checkpoint.persisting.health import StorageHealth
from unbroken.checkpoint.persisting.hooks import WriterHooks
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev
from unbroken.mask import masked

logger = logging.getLogger(__name__)

_changes = 0


def changed() -> None:
    """A commit was seen, or a Checkpointer created, closed or aborted (an ``Inflight``
    made, closed or its writer killed): see ``generation``."""
    global _changes
    _changes += 1


def generation() -> int:
    """A number that changes whenever the committed steps of this process's open
    Checkpointers may have: what is computed from them on every step (the launcher
    heartbeat's) is computed again only then."""
    return _changes


_POLL_S = 0.005

Outcome = Literal["persisted", "committed", "abandoned", "failed"]


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
    """Saves that failed (the writer died, storage stalled, the writer reported an error)."""
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

    def copy(self) -> CheckpointStats:
        """A copy of these counters.

        Returns:
            A copy that later saves do not change.
        """
        return dataclasses.replace(
            self,
            stall_s=list(self.stall_s),
            persist_s=list(self.persist_s),
            commit_s=list(self.commit_s),
        )


@dataclass
class Save:
    """One save from staging to its outcome."""

    step: int
    staged: threading.Event = field(default_factory=threading.Event)
    """Set once every tensor is copied and the save handed to the writer (or staging failed)."""
    sent_ts: float | None = None
    outcome: Outcome | None = None
    error: str | None = None
    written: bool = False
    """The writer has written this rank's data: it reads the staged bytes no more."""

    @property
    def done(self) -> bool:
        return self.outcome is not None


class Inflight:
    """The save in flight on one rank and the writer process persisting it."""

    def __init__(
        self,
        *,
        root: Path,
        rank: int,
        world_size: int,
        config: CheckpointConfig,
        recorder: Recorder,
        stats: CheckpointStats,
    ) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.recorder = recorder
        self.stats = stats
        self.writer: WriterClient | None = None
        self.current: Save | None = None
        """The newest save handed over (done or not), or None before the first."""
        self.last_committed: int | None = None
        """Newest step seen committed (rank 0 only: it commits), else None."""
        changed()  # a Checkpointer made
        self.health = StorageHealth(config)
        """The failing periods of this rank's storage and the back-off between attempts."""
        self._cond = threading.Condition()
        self._replace = False  # the writer was killed or died: start another at the next save
        self._retired: list[WriterClient] = []

    # --- the writer --------------------------------------------------------------------------
    @masked  # a writer started is a writer held: no interrupt between the fork and here
    def start_writer(self, hooks: WriterHooks | None) -> tuple[WriterClient, bool]:
        """The writer process, started (with ``hooks`` sent to it) on the first call, and
        again after the last one was killed or died.

        Returns:
            The writer, and whether it was started by this call (it has no arena yet).
        """
        if self.writer is not None and (self._replace or not self.writer.alive()):
            self.writer.kill_nowait()
            self._retired.append(self.writer)  # reaped at ``close``: it may be stuck in I/O
            self.writer, self._replace = None, False
        fresh = self.writer is None
        if self.writer is None:
            self.writer = WriterClient(
                root=self.root,
                rank=self.rank,
                world_size=self.world_size,
                keep=self.config.keep,
                commit_timeout_s=self.config.persist_timeout_s,
                throttle_bytes_per_s=self.config.throttle_mbps * 1e6,
                nice=self.config.writer_nice,
                idle=self.config.writer_idle,
                start=self.config.writer_start,
                on_message=self._on_message,
                on_death=self._on_death,
            )
            if hooks is not None:
                self.writer.send({"type": "hooks", "hooks": hooks})
        return self.writer, fresh

    def begin(self, step: int) -> Save:
        """A new save of ``step`` is being staged: it is the one in flight now."""
        save = Save(step=step)
        with self._cond:
            self.current = save
        return save

    def busy(self) -> bool:
        """True while the current save has no outcome yet."""
        return self.current is not None and not self.current.done

    def reading(self) -> bool:
        """True while the writer may still read the current save's staged bytes."""
        save = self.current
        return save is not None and not save.done and not save.written

    def send(self, msg: dict[str, Any], save: Save) -> None:
        """Hand the staged ``save`` to the writer (from the training or the stager thread)."""
        assert self.writer is not None
        msg["sent_ts"] = time.time()
        save.sent_ts = msg["sent_ts"]
        try:
            self.writer.send(msg)
        except CheckpointError as e:  # the writer is gone: a failed save, not a training error
            self.fail(f"{e}; the save of step {save.step} is lost", save.step)
        finally:
            save.staged.set()

    def staging_failed(self, save: Save, e: Exception) -> None:
        self.finish(save, "failed", f"staging failed: {type(e).__name__}: {e}")
        save.staged.set()

    # --- what the writer says (its reader thread) --------------------------------------------
    def _on_message(self, msg: dict[str, Any]) -> None:
        kind, step = msg["type"], msg["step"]
        save = self.current
        if save is None or save.step != step:
            logger.warning("checkpoint writer reported %s for step %s, not in flight", kind, step)
            return
        if kind == "written":  # its staged bytes are in the file (not yet fsynced)
            save.written = True
        elif kind == "persisted":
            save.written = True
            self.stats.persist_s.append(msg["end"] - msg["begin"])
            self.recorder.interval(
                ev.CKPT_PERSIST,
                begin=msg["begin"],
                end=msg["end"],
                step=step,
                bytes=msg["bytes"],
                write_s=msg["write_s"],
                fsync_s=msg["fsync_s"],
                writer_rss_bytes=msg["rss_bytes"],
                # the write-rate cap this save obeyed (bytes/s; 0: none), a slow-storage
                # fault's included: which saves were slow by design, not by the storage
                throttle_bytes_per_s=msg["throttle_bytes_per_s"],
            )
            if self.rank != 0:
                self.stats.committed += 1
                self._succeeded(step)
                self.finish(save, "persisted")
        elif kind == "committed":
            self.stats.commit_s.append(msg["end"] - msg["begin"])
            self.stats.committed += 1
            self.recorder.emit(
                ev.CKPT_COMMIT,
                ts=msg["end"],
                step=step,
                commit_s=msg["end"] - msg["begin"],
                path=msg["path"],
                removed=msg["removed"],
            )
            self.last_committed = step
            changed()
            self._succeeded(step)
            self.finish(save, "committed")
        elif kind == "abandoned":
            self.stats.skipped += 1
            self.recorder.emit(ev.CKPT_SKIP, step=step, reason=f"abandoned: {msg['reason']}")
            self.finish(save, "abandoned")
        elif kind == "failed":
            self._failed(step, f"checkpoint of step {step} failed: {msg['error']}")
            self.finish(save, "failed", msg["error"])

    def _on_death(self, reason: str) -> None:
        """The moment the writer's socket closes (not when it was killed on purpose)."""
        save = self.current
        step = save.step if save and not save.done else None
        lost = f"; the save of step {step} is lost" if step is not None else ""
        self.fail(
            f"{reason}{lost}; the newest committed checkpoint is {self.last_committed_on_disk()}",
            step,
        )

    def fail(self, message: str, step: int | None) -> None:
        """The writer was killed, died or cannot be reached: record a failed save, end the one
        in flight as failed, and start another writer at the next save."""
        save = self.current
        with self._cond:
            if step is not None and save is not None and save.step == step and save.done:
                return  # already ended (reported by the writer, or by its death)
            self._replace = True
        self._failed(step, message)
        if save is not None and not save.done:
            self.finish(save, "failed", message)

    def _failed(self, step: int | None, message: str) -> None:
        self.stats.failed += 1
        self.recorder.emit(ev.CKPT_FAIL, step=step, error=message)
        backoff = self.health.failed(message)
        logger.warning(
            "%s; training goes on (memory snapshots only), the next durable save in %.1f s",
            message,
            backoff,
        )

    def _succeeded(self, step: int) -> None:
        period = self.health.succeeded()
        if period is not None:
            logger.warning(
                "checkpoint storage is back: step %d is durable after %.1f s without a durable "
                "checkpoint",
                step,
                period,
            )

    def finish(self, save: Save, outcome: Outcome, error: str | None = None) -> None:
        with self._cond:
            if save.outcome is None:
                save.outcome, save.error = outcome, error
            self._cond.notify_all()

    # --- waiting and checks (training thread) ------------------------------------------------
    def wait_staged(self) -> None:
        """Block until the current save is fully copied (see ``Checkpointer.wait_staged``)."""
        save = self.current
        if save is None or save.staged.is_set():
            return
        t0 = time.time()
        while not save.staged.wait(0.1):
            if save.done:
                break
        end = time.time()
        if self.stats.stall_s:
            self.stats.stall_s[-1] += end - t0
        self.stats.blocking_s += end - t0
        self.recorder.interval(ev.CKPT_STAGE, begin=t0, end=end, step=save.step, part="overlap")

    def wait_done(self) -> None:
        """Block until the current save has an outcome (failed: past its deadline)."""
        save = self.current
        if save is None:
            return
        with self._cond:
            while not save.done:
                self._cond.wait(0.1)
                if self._deadline_passed(save):
                    break

    def wait_commit_on_disk(self, save: Save) -> None:
        """Ranks but 0: after this rank's data persisted, watch for rank 0's commit."""
        from unbroken.checkpoint.persisting.commit import abandon_reason

        marker = layout.step_dir(self.root, save.step) / layout.COMMITTED
        part = layout.partial_dir(self.root, save.step)
        deadline = time.time() + self.config.persist_timeout_s
        while not marker.exists():
            try:
                why = abandon_reason(part) if part.exists() else None
            except OSError as e:  # the directory is unreadable: rank 0 cannot commit either
                why = f"{type(e).__name__}: {e}"
            if why and not marker.exists():
                self.recorder.emit(ev.CKPT_SKIP, step=save.step, reason=f"abandoned: {why}")
                return
            if time.time() > deadline:
                self._failed(
                    save.step,
                    f"step {save.step} was not committed by rank 0 within "
                    f"{self.config.persist_timeout_s:.1f} s; is rank 0 alive?",
                )
                return
            time.sleep(_POLL_S)

    def _deadline_passed(self, save: Save) -> bool:
        writer = self.writer
        if save.done or save.sent_ts is None or writer is None:
            return False
        now = time.time()
        if writer.ready_ts is None:
            if now - writer.spawn_ts <= self.config.writer_start_timeout_s:
                return False
            self.fail(
                f"checkpoint writer process {writer.pid} not ready after "
                f"{self.config.writer_start_timeout_s:.0f} s (writer_start_timeout_s)",
                save.step,
            )
            writer.kill_nowait()
            return True
        if now - max(save.sent_ts, writer.ready_ts) <= self.config.persist_timeout_s:
            return False
        self.fail(
            f"the save of step {save.step} was not durable after "
            f"{self.config.persist_timeout_s:.1f} s (persist_timeout_s): storage stalled? "
            f"Its writer was killed; the newest committed checkpoint is {self.last_committed_on_disk()}",
            save.step,
        )
        if self.writer is not None:
            self.writer.kill_nowait()
        return True

    def poll(self) -> None:
        """Fail the save in flight when it is past its deadline (stalled storage, a writer
        that never became ready)."""
        save = self.current
        if save is not None:
            self._deadline_passed(save)

    def skip(self, step: int, reason: str, *, retried: bool = False) -> None:
        """Record a save of ``step`` dropped on this rank; tell the coordinator not to wait.
        ``retried``: held back, to be staged at a later step (its record says so)."""
        self.stats.skipped += 1
        if self.world_size > 1:
            try:
                layout.write_marker(
                    layout.partial_dir(self.root, step) / layout.skip_marker(self.rank),
                    {"reason": reason},
                )
            except OSError as e:  # failing storage: rank 0 cannot commit this step either
                logger.debug("cannot mark step %d skipped: %s", step, e)
        self.recorder.emit(
            ev.CKPT_SKIP, step=step, reason=reason, **({"retried": True} if retried else {})
        )

    def last_committed_on_disk(self) -> int | None:
        """The newest committed step in the checkpoint directory (None: none, or unreadable)."""
        try:
            steps = layout.committed_steps(self.root)
        except OSError:
            return None
        return steps[0] if steps else None

    # --- the end -----------------------------------------------------------------------------
    def kill_writer(self) -> None:
        """SIGKILL the writer without waiting (``close`` reaps it)."""
        changed()  # an abort: its Checkpointer is closed
        if self.writer is not None:
            self.writer.kill_nowait()

    def close(self) -> None:
        """Stop the writer (it finishes the message it is on) and reap it, and the writers
        replaced before it."""
        changed()  # its Checkpointer is closed
        if self.writer is not None:
            self.writer.close()
        for old in self._retired:
            old.close(timeout_s=1.0)
        self._retired.clear()
