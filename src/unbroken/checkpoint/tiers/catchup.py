"""A newer step than every rank holds, from the ranks that hold it, when the model and
optimizers are the same on every rank (data parallel).

After a SIGKILL the killed rank's new process holds the last snapshot, while a surviving rank
rescued the step it noted (``rescue``; the launcher gives it a moment before stopping it):
the newest step every rank holds is the snapshot's, steps behind. When the model and
optimizers are replicated, the killed rank's model and optimizers at the newer step are the
survivor's, and its own values at that step (the generators, a data cursor) are in its
journal (``staging.journal``). So, after ``from_memory`` restored the newest common step:

1. every rank tells (one all-gather) its newest sealed step, the step of its journal (when
   its values can be loaded in place), and a digest of its model and optimizer tensors at
   the common step (their snapshot digests): equal digests on every rank mean replicated;
2. when some ranks hold a newer step, every other rank's journal is of that step, and the
   digests agree, the holders check and load it from their memory (one more all-gather of
   their verdicts), the lowest holder broadcasts its model and optimizers' state dicts, and
   the others load them and their journal's values.

Otherwise nothing changes: the common step stands. A sharded state (FSDP) differs by rank
and is never caught up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from unbroken.checkpoint.staging import journal, memory

logger = logging.getLogger(__name__)


def _objects(state: Mapping[str, Any]) -> list[str]:
    return sorted(k for k, v in state.items() if isinstance(v, (nn.Module, torch.optim.Optimizer)))


def _fingerprint(snap: memory.Snapshot | None, objects: list[str]) -> int | None:
    """One digest of the model and optimizer tensors of ``snap`` (their own digests)."""
    if snap is None or not objects:
        return None
    h = xxhash.xxh3_64()
    for (index, _slot), digest in sorted(
        zip(snap.tensors, snap.digests, strict=True), key=lambda x: str(x[0][0].fqn)
    ):
        if index.fqn.split(".", 1)[0] in objects:
            h.update(f"{index.fqn}:{index.offset}:{digest};".encode())
    return h.intdigest()


class _Hole:
    """Where the ``index``-th tensor of a state dict goes (its skeleton travels pickled)."""

    def __init__(self, index: int) -> None:
        self.index = index


def _carve(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by a ``_Hole`` (appended to ``tensors``)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous())
        return _Hole(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _carve(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_carve(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Hole):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else device
    return torch.empty(shape, dtype=dtype, device=where)


def _broadcast(state: Mapping[str, Any], objects: list[str], src: int, holder: bool) -> None:
    """The state dicts of ``objects`` from rank ``src``, loaded on the ranks not ``holder``."""
    for key in objects:
        tensors: list[torch.Tensor] = []
        box: list[Any] = [None]
        if holder:
            skeleton = _carve(state[key].state_dict(), tensors)
            box = [(skeleton, [(tuple(t.shape), t.dtype, t.device.type) for t in tensors])]
        dist.broadcast_object_list(box, src=src)
        skeleton, metas = box[0]
        if not holder:
            tensors = [_empty(*meta) for meta in metas]
        for t in tensors:
            dist.broadcast(t, src=src)
        if not holder:
            state[key].load_state_dict(_fill(skeleton, tensors))


def catch_up(
    state: Mapping[str, Any],
    arena: Any,
    common: int,
    *,
    rank: int,
    world_size: int,
    entry: journal.Entry | None,
    verify: bool,
    untrusted: bool = False,
) -> tuple[int, str] | None:
    """After ``common`` was restored into ``state``: the newer step loaded (see the module
    docstring) and how, or None (``common`` stands). Collective: one all-gather, then, when
    a newer step qualifies, one more and the broadcasts."""
    objects = _objects(state)
    mine: dict[int, memory.Snapshot] = {}
    if arena is not None:
        for snap in memory.read(arena)[1]:
            if (snap.rank, snap.world_size) == (rank, world_size):
                mine.setdefault(snap.step, snap)
    newest = max(mine, default=None)
    noted = None
    if entry is not None and entry.step > common and journal.can_apply(entry, state) is None:
        noted = entry.step
    told = (newest, noted, _fingerprint(mine.get(common), objects))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, told)
    newer = max((g[0] for g in gathered if g[0] is not None), default=None)
    if newer is None or newer <= common:
        return None
    holders = [r for r, g in enumerate(gathered) if g[0] == newer]
    others = [r for r in range(world_size) if r not in holders]
    prints = {g[2] for g in gathered}
    if not objects or None in prints or len(prints) != 1:
        logger.info("step %d held by ranks %s only: the model is not replicated", newer, holders)
        return None
    if any(gathered[r][1] != newer for r in others):
        logger.info("step %d held by ranks %s only: the others noted no such step", newer, holders)
        return None
    pending, verdict = None, None
    if rank in holders:
        try:
            if verify:
                verdict = memory.verify(mine[newer], untrusted=untrusted)
            if verdict is None:
                pending = memory.prepare(state, mine[newer], rank=rank)
        except memory.Mismatch as e:
            verdict = f"step {newer} does not fit: {e}"
    verdicts: list[Any] = [None] * world_size
    dist.all_gather_object(verdicts, verdict)
    if any(verdicts):
        logger.warning("step %d not caught up: %s", newer, [v for v in verdicts if v])
        return None
    if pending is not None:
        pending.apply()
    _broadcast(state, objects, holders[0], rank in holders)
    if rank not in holders:
        assert entry is not None
        journal.apply(entry, state)
    return newer, (
        f"step {newer} from rank {holders[0]}'s memory: the model and optimizers are the same "
        f"on every rank; ranks {others} took their own values from their journal"
    )
