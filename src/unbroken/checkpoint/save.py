"""A Checkpointer's save side (``Saves``): its parts, and one save, snapshot or note through them.

``Checkpointer`` is the API; ``Saves`` owns what a save passes through, from the trainer's
call to the hand-off: the writer's in-flight save (``persisting.inflight``), the staging arena
(``staging``), the resolve cache, the rescue's notes, the state's extras, the counters. In
order, a save (``stage``): the previous save's overlapped copy is waited for; a save while the
previous one persists is skipped (``on_busy`` "skip": with the memory tier it is still a
snapshot) or waits for it; while storage fails, a save inside the back-off is a snapshot too
(``persisting.health``; under ``on_storage_failure="stop"``, the final attempt is waited for
and ``StorageFailed`` raised when it fails); with one copy per rank (lean), the ranks agree to
replace it (one all-reduce) or hold the save back to the next step (a writer still reads it);
the state is resolved into write items (``resolve``), the arena prepared and a region taken
(``staging``), what may change before ``optimizer.step`` copied now and the rest after, on the
stager thread (``overlap``), and the region sealed (on the stager thread too from
``SEAL_LATER_BYTES``); a durable save is then handed to the writer process
(``inflight``), and the blocking time is recorded as a ``ckpt_stage`` interval. ``note`` is
the rescue's record of a step (``rescue``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from unbroken.checkpoint import node
from unbroken.checkpoint.config import CheckpointConfig, CheckpointError, StorageFailed
from unbroken.checkpoint.persisting.hooks import WriterHooks
from unbroken.checkpoint.persisting.inflight import CheckpointStats, Inflight
from unbroken.checkpoint.schedule.adaptive import max_over_ranks
from unbroken.checkpoint.staging.rescue import Notes
from unbroken.checkpoint.staging.staging import SEAL_LATER_BYTES, Staging, fill, process_memory
from unbroken.checkpoint.state.extras import StateExtras
from unbroken.checkpoint.state.resolve import ResolveCache, plan_args, resolve_for_save
from unbroken.ledger import Recorder, phases
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)


def _log_failed(step: int, e: Exception) -> None:
    logger.warning("snapshot of step %d not kept in memory: %s", step, e)


class Saves:
    """The save side of one rank's ``Checkpointer``.

    Args:
        root: The checkpoint directory.
        config: The Checkpointer's settings.
        rank: This rank.
        world_size: The ranks of the group.
        run: The run recorded in the manifests (None: unnamed).
        ledger: Where saves are recorded.
        hooks: The fault plan's writer hooks (slow or failing storage).
        staging: The staging arena (and memory tier) of this rank.
    """

    def __init__(
        self,
        *,
        root: Path,
        config: CheckpointConfig,
        rank: int,
        world_size: int,
        run: str | None,
        ledger: Recorder,
        hooks: WriterHooks | None,
        staging: Staging,
    ) -> None:
        self.config, self.rank, self.world_size, self.run = config, rank, world_size, run
        self.ledger, self.hooks, self.staging = ledger, hooks, staging
        self.stats = CheckpointStats()
        self.inflight = Inflight(
            root=root,
            rank=rank,
            world_size=world_size,
            config=config,
            recorder=ledger,
            stats=self.stats,
        )
        self.cache = ResolveCache()
        self.notes = Notes()
        self._told_refused = ""
        self._told_j = False
        self._note_args: tuple[Any, Any] = (None, None)
        """(the state's keys and value types, ``plan_args`` for them) of the last note."""
        self.extras = StateExtras(config)  # the generators; the state for the digest
        self.last_step: int | None = None
        """The step staged (or restored) last."""
        self.persisting_region: int | None = None
        self.pending: bool | None = None
        """Lean: a save (True) or snapshot (False) the ranks agreed not to stage yet (a
        rank's writer still read its one snapshot): ``maybe_save`` tries again every step."""
        self.closed = False
        self.prepared = False
        """``prepare_ahead`` ran (it runs once)."""
        self.resolved = False
        """The state was resolved (a save, a snapshot, ``prepare_ahead``): a plan learned if
        it can be."""

    def check(self) -> None:
        """Fail the save in flight when it is past its deadline (``Inflight.poll``).

        Raises:
            CheckpointError: When closed."""
        if self.closed:
            raise CheckpointError("this Checkpointer is closed")
        self.inflight.poll()

    def blocked(self, t0: float, step: int | None, part: str, *, lazy: bool = False) -> float:
        """Record ``[t0, now]`` as the trainer blocked by ``part`` of a save (``lazy``: as
        ``Recorder.interval`` takes it).

        Returns:
            now."""
        end = time.time()
        self.stats.blocking_s += end - t0
        self.ledger.interval(ev.CKPT_STAGE, begin=t0, end=end, lazy=lazy, step=step, part=part)
        return end

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot is fully copied (``Checkpointer.wait_staged``)."""
        if self.staging.copying:
            t0, part = time.time(), self.staging.waiting_for
            self.staging.wait()
            end = self.blocked(t0, self.last_step, part)
            if self.stats.stall_s:
                self.stats.stall_s[-1] += end - t0
        self.inflight.wait_staged()

    def wait(self) -> bool:
        """Block until the in-flight save has an outcome (``Checkpointer.wait``).

        Returns:
            False when the newest save handed to the writer failed or was abandoned.

        Raises:
            CheckpointError: When the Checkpointer is closed.
        """
        self.check()
        self.wait_staged()
        inflight = self.inflight.current
        if inflight is None:
            return True
        with node.waiting():  # no progress, for a known reason (``node``)
            self.inflight.wait_done()
            if self.rank != 0 and inflight.outcome == "persisted":
                self.inflight.wait_commit_on_disk(inflight)
        self.check()
        return inflight.outcome in ("persisted", "committed")

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        durable: bool,
        last: bool = False,
        rescue: bool = False,
    ) -> bool:
        """``stage`` in the ``save`` phase when ``durable``.

        Returns:
            As ``stage``."""
        with phases.region("save") if durable else contextlib.nullcontext():
            return self.stage(step, state, durable=durable, last=last, rescue=rescue)

    def stage(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        durable: bool,
        last: bool = False,
        rescue: bool = False,
    ) -> bool:
        """Stage ``state`` as ``step``: a save (``durable``) or a memory snapshot.

        Args:
            step: The step just completed (0-based).
            state: As ``Checkpointer.save`` takes it.
            durable: A save (handed to the writer); False: a snapshot in memory only.
            last: The job's last save (a preemption): never held back or skipped, and waited
                for (``wait`` tells whether it is durable).
            rescue: A snapshot of a noted step as the process unwinds from a fault
                (``rescue``): lean, it goes to the spare region, without the ranks' agreement.

        Returns:
            False when skipped (a save while the previous one persists, without the memory tier,
            or a step just staged; lean: held back while a rank's writer still reads its one
            snapshot, ``pending``).

        Raises:
            CheckpointError: When an earlier save failed, ``ck`` is closed, or (sync) this one
                failed.
        """
        given, asked, t0, state = state, durable, time.time(), self.extras.full(state)
        self.check()
        if step == self.last_step and not last:
            return False
        if self.config.overlap:
            self.staging.hook(state, self.wait_staged)
        self.wait_staged()
        waited = 0.0
        busy = self.inflight.busy()
        skipped = False
        health = self.inflight.health
        final = durable and health.final_due()  # "stop": the last attempt, waited for
        must = final or last  # never held back or skipped
        held_back = None if must or not durable else health.hold()
        if held_back:  # storage failing: back off (still a snapshot in memory)
            self.inflight.skip(step, held_back)
            if not self.config.memory_tier:
                self.stats.blocking_s += time.time() - t0
                return False
            durable, skipped = False, True
        elif busy and durable:
            current = self.inflight.current
            assert current is not None
            skip = self.config.mode == "async" and self.config.on_busy == "skip"
            if skip and not must:
                self.inflight.skip(step, f"the save of step {current.step} is still persisting")
                if not self.config.memory_tier:
                    self.stats.blocking_s += time.time() - t0
                    return False
                durable, skipped = False, True  # still a snapshot in memory
            else:
                with node.waiting():
                    self.inflight.wait_done()
                waited = time.time() - t0
                busy = False
        if self.staging.lean and not rescue:
            if not self._agreed(self.inflight.reading()):
                return self._refused(step, given, t0, durable=asked, marked=skipped)
            self.pending = None
        writer = None
        if durable or not health.failing:  # no new writer for a snapshot while storage fails
            writer, fresh = self.inflight.start_writer(self.hooks)
            if fresh:
                self.staging.new_writer()
        t1 = time.time()
        resolved = resolve_for_save(
            state,
            rank=self.rank,
            world_size=self.world_size,
            overlap=self.config.overlap,
            cache=self.cache,
            stage_all=self.config.memory_tier,
            defer=not durable and self.config.overlap,  # torch.save on the stager thread
        )
        staging = self.staging
        tensors = [i for i in resolved.items if i.tensor is not None]
        values = [i for i in resolved.items if i.tensor is None]
        alloc_s = staging.prepare(tensors, sum(i.nbytes for i in values), writer)
        t2 = time.time()
        region, _ = staging.begin(pinned=self.persisting_region if busy else None, rescue=rescue)
        now_src, now_dst, later_src, later_dst = staging.split(region, tensors)
        staging.copy_now(now_src, now_dst)
        self.last_step = step
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
            inflight = self.inflight.begin(step)
            self.persisting_region = region
            done: Callable[[], None] = functools.partial(self.inflight.send, msg, inflight)
            failed: Callable[[Exception], None] = functools.partial(
                self.inflight.staging_failed, inflight
            )
        else:
            done, failed = (lambda: None), functools.partial(_log_failed, step)
        seal_later = sealing and (
            self.config.overlap or sum(t.nbytes for t in tensors) >= SEAL_LATER_BYTES
        )
        if later_src or seal_later:
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
        self.resolved = True
        nbytes = sum(i.nbytes for i in resolved.items)
        self.stats.staged_bytes = nbytes
        if durable:
            self.stats.saves += 1
            phases.entered("persist")  # handed to the writer (or on its way to it)
            if self.config.mode == "sync" or final:
                ok = self.wait()
                if final and not ok:
                    raise StorageFailed(self._stopping(step))
        end = time.time()
        self.stats.stall_s.append(end - t0)
        self.stats.blocking_s += end - t0
        memory: dict[str, Any] = process_memory() if durable else {}  # /proc, once per save
        self.ledger.interval(
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
            **memory,
        )
        return not skipped

    def prepare_ahead(self, state: Mapping[str, Any]) -> None:
        """At the first step that is no save, once: resolve the state, which learns the plan
        that notes need (so a soft fault before the first save, or right after a restore,
        rescues its step), and before the first save of a large state
        (``SEAL_LATER_BYTES``) lay out, allocate and fault in its staging arena on the stager
        thread while training goes on (``Staging.prepare_later``), so that the first save
        copies instead of faulting in gigabytes (and, on a GPU, registering them as pinned)."""
        if self.prepared or not self.config.memory_tier or self.closed:
            return
        self.prepared = True
        if self.cache.plan is not None:  # a save came first
            return
        resolved = resolve_for_save(
            self.extras.full(state),
            rank=self.rank,
            world_size=self.world_size,
            overlap=self.config.overlap,
            cache=self.cache,
            stage_all=True,
        )
        self.resolved = True
        if self.staging.arena.size:  # adopted (a restore from memory)
            return
        tensors = [i for i in resolved.items if i.tensor is not None]
        if sum(i.nbytes for i in tensors) >= SEAL_LATER_BYTES:
            values = sum(i.nbytes for i in resolved.items if i.tensor is None)
            self.staging.prepare_later(tensors, values)

    def _agreed(self, reading: bool) -> bool:
        """Lean: may every rank replace its one snapshot now? One all-reduce (every rank
        stages the same steps): a rank that faulted before getting here keeps the others from
        replacing the step they hold in common, and a rank whose writer still ``reading`` its
        snapshot (the last save's data not yet written) keeps every rank from staging."""
        if self.world_size == 1:
            return not reading
        return max_over_ranks([1.0 if reading else 0.0])[0] == 0.0

    def _refused(
        self, step: int, state: Mapping[str, Any], t0: float, *, durable: bool, marked: bool
    ) -> bool:
        """Lean, a rank's writer still reads its one snapshot: no save or snapshot of ``step``
        anywhere (noted instead, for a rescue); it is ``pending``. ``marked``: the save's skip
        is recorded already."""
        if durable and not marked:
            self.inflight.skip(
                step, "a rank's writer still writes the last save from its copy", retried=True
            )
        self.pending = durable or bool(self.pending)
        self.blocked(t0, step, "agree")
        self.note(step, state)
        return False

    def _stopping(self, step: int) -> str:
        status = self.inflight.health.status()
        failing_s = 0.0 if status.failing_since is None else time.time() - status.failing_since
        return (
            f"checkpoint storage has failed for {failing_s:.0f} s "
            f"(storage_failure_limit_s={self.config.storage_failure_limit_s:g}) and the final "
            f"save, of step {step}, failed too: {status.last_error}. on_storage_failure='stop' "
            f"ends the job; the newest committed checkpoint ({self.inflight.last_committed_on_disk()}) "
            "is intact: fix the storage and start the job again"
        )

    def rescue(self) -> None:
        """Snapshot the noted step from the live state if nothing changed since the note
        (``rescue.Notes.rescue``), as the process unwinds from a fault (``abort``)."""
        if self.config.memory_tier and self.config.rescue:
            save = functools.partial(self.save, rescue=True)
            self.notes.rescue(self.last_step, self.cache.plan, save, self.staging.wait)

    def note(self, step: int, state: Mapping[str, Any]) -> bool:
        """Note ``step`` of ``state`` without staging it (``rescue.Notes.take``).

        Args:
            step: The step just completed (0-based).
            state: As ``Checkpointer.save`` takes it.

        Returns:
            True when noted (see ``Checkpointer.note``).
        """
        if not (self.config.memory_tier and self.config.rescue) or self.closed:
            return False
        t0, o, w = time.time(), self.config.overlap, self.world_size
        state = self.extras.full(state)
        kinds = (tuple(state), tuple(map(type, state.values())))  # what plan_args depends on
        if kinds != self._note_args[0]:
            args = plan_args(state, rank=self.rank, world_size=w, overlap=o, stage_all=True)
            self._note_args = (kinds, args)
        if not self.notes.take(step, state, self.cache.plan, self._note_args[1]):
            # Refused at once (before the first save, a model with buffers): said once a reason.
            why = self.notes.refused
            if self.cache.plan is None and self.resolved:  # it learned no plan from a save
                why = "the state holds no nn.Module and optimizers whose tensors a save tracks"
            if self.resolved and why != self._told_refused:
                self._told_refused = why
                logger.info(
                    "rank %d: steps between snapshots are not noted (%s): a fault restores "
                    "the last snapshot",
                    self.rank,
                    why,
                )
            return False
        journal, note, plan = self.staging.journal, self.notes.note, self.cache.plan
        if journal is not None and note is not None and plan is not None:
            written = journal.write(step, note.state, plan.objects.keys())
            if not written and not self._told_j:
                self._told_j = True
                logger.info("rank %d: noted steps not journaled: %s", self.rank, journal.refused)
        self.blocked(t0, step, "note", lazy=True)  # one every step: no thread woken for it
        return True
