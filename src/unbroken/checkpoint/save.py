"""One save, snapshot or note of a ``Checkpointer``, from the trainer's call to the hand-off.

``stage`` is the body of ``Checkpointer.save`` and ``snapshot``, ``note`` that of
``Checkpointer.note`` (the rescue's record of a step: ``rescue``), kept apart so that each file
reads in one sitting; it works on the Checkpointer's parts. In order: the previous save's
overlapped copy is waited for; a save while the previous one persists is skipped (``on_busy``
"skip": with the memory tier it is still a snapshot) or waits for it; the state is resolved
into write items (``resolve``), the arena prepared and a region taken (``staging``), what may
change before ``optimizer.step`` copied now and the rest after, on the stager thread
(``overlap``); a durable save is then handed to the writer process (``inflight``), and the
blocking time is recorded as a ``ckpt_stage`` interval.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from unbroken.checkpoint import node
from unbroken.checkpoint.staging.staging import fill, process_memory
from unbroken.checkpoint.state.resolve import plan_args, resolve_for_save
from unbroken.ledger import events as ev
from unbroken.ledger import phases

if TYPE_CHECKING:
    from unbroken.checkpoint.checkpointer import Checkpointer

logger = logging.getLogger(__name__)


def _log_failed(step: int, e: Exception) -> None:
    logger.warning("snapshot of step %d not kept in memory: %s", step, e)


def stage(ck: Checkpointer, step: int, state: Mapping[str, Any], *, durable: bool) -> bool:
    """Stage ``state`` as ``step`` for ``ck``: a save (``durable``) or a memory snapshot.

    Args:
        ck: The Checkpointer whose save this is.
        step: The step just completed (0-based).
        state: As ``Checkpointer.save`` takes it.
        durable: A save (handed to the writer); False: a snapshot in memory only.

    Returns:
        False when skipped (a save while the previous one persists, without the memory tier,
        or a step just staged).

    Raises:
        CheckpointError: When an earlier save failed, ``ck`` is closed, or (sync) this one
            failed.
    """
    t0, state = time.time(), ck._extras.full(state)
    ck._check()
    if step == ck._last_step:
        return False
    if ck.config.overlap:
        ck._staging.hook(state, ck.wait_staged)
    ck.wait_staged()
    waited = 0.0
    busy = ck._inflight.busy()
    skipped = False
    if busy and durable:
        current = ck._inflight.current
        assert current is not None
        if ck.config.mode == "async" and ck.config.on_busy == "skip":
            ck._inflight.skip(step, f"the save of step {current.step} is still persisting")
            if not ck.config.memory_tier:
                ck._stats.blocking_s += time.time() - t0
                return False
            durable, skipped = False, True  # still a snapshot in memory
        else:
            with node.waiting():
                ck._inflight.wait_done()
            waited = time.time() - t0
            busy = False
    writer = ck._inflight.start_writer(ck._hooks)
    t1 = time.time()
    resolved = resolve_for_save(
        state,
        rank=ck.rank,
        world_size=ck.world_size,
        overlap=ck.config.overlap,
        cache=ck._cache,
        stage_all=ck.config.memory_tier,
        defer=not durable and ck.config.overlap,  # torch.save on the stager thread
    )
    staging = ck._staging
    tensors = [i for i in resolved.items if i.tensor is not None]
    values = [i for i in resolved.items if i.tensor is None]
    alloc_s = staging.prepare(tensors, sum(i.nbytes for i in values), writer)
    t2 = time.time()
    region, _ = staging.begin(pinned=ck._persisting_region if busy else None)
    now_src, now_dst, later_src, later_dst = staging.split(region, tensors)
    staging.copy_now(now_src, now_dst)
    ck._last_step = step
    held = staging.snapshot(step, region, world_size=ck.world_size)
    sealing = ck.config.memory_tier
    if durable:
        msg = {
            "type": "save",
            "step": step,
            "layout_id": staging.layout_id,
            "base": staging.data_base(region),
            "payloads": [(i.write_item, i.payload) for i in values],
            "assigned": resolved.assigned,
            "planner_data": resolved.planner_data,
            "run": ck.run,
        }
        inflight = ck._inflight.begin(step)
        ck._persisting_region = region
        done: Callable[[], None] = functools.partial(ck._inflight.send, msg, inflight)
        failed: Callable[[Exception], None] = functools.partial(
            ck._inflight.staging_failed, inflight
        )
    else:
        done, failed = (lambda: None), functools.partial(_log_failed, step)
    if later_src or (sealing and ck.config.overlap):
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
    ck._stats.staged_bytes = nbytes
    if durable:
        ck._stats.saves += 1
        phases.entered("persist")  # handed to the writer (or on its way to it)
        if ck.config.mode == "sync":
            ck.wait()
    end = time.time()
    ck._stats.stall_s.append(end - t0)
    ck._stats.blocking_s += end - t0
    ck._ledger.interval(
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
        mode=ck.config.mode,
        durable=durable,
        region=region,
        staging_bytes=staging.size,
        queue_depth=1 if busy else 0,
        **(process_memory() if durable else {}),  # /proc, once per durable save
    )
    return not skipped


def note(ck: Checkpointer, step: int, state: Mapping[str, Any]) -> bool:
    """Note ``step`` of ``state`` for ``ck`` without staging it (``rescue.Notes.take``).

    Args:
        ck: The Checkpointer whose note this is.
        step: The step just completed (0-based).
        state: As ``Checkpointer.save`` takes it.

    Returns:
        True when noted (see ``Checkpointer.note``).
    """
    if not (ck.config.memory_tier and ck.config.rescue) or ck._closed:
        return False
    t0, o, w = time.time(), ck.config.overlap, ck.world_size
    state = ck._extras.full(state)
    args = plan_args(state, rank=ck.rank, world_size=w, overlap=o, stage_all=True)
    if not ck._notes.take(step, state, ck._cache.plan, args):
        return False  # refused at once (before the first save, a model with buffers)
    ck._blocked(t0, step, "note")
    return True
