"""The agent's side of handing this node's workers over to the next round after another node
is lost (the worker's side, and the keys, are ``unbroken.restart.handover``'s docstring).

Why: a worker that a new process replaces pays its start again (the warm pool's fork, the
script's imports, the process group) and then a slow first step (every cache of a new process
cold: FSDP2 plans the sharding of every parameter shape again). When a node is lost, the
surviving nodes' workers are healthy: paused, they leave ``fn`` and wait; handed over, they take
their ranks in the next round and run ``fn`` again, restoring from memory as any restart does,
with those caches warm. Only the replacement node's workers start cold.

The agent pauses its workers only when the round ended for lost nodes alone,
``LauncherConfig.handover`` is on, and every worker runs and listens (``ready``: a script
without in-process restart does not); it hands them over only when every one still runs once
the next round has formed, with their ranks where they were (``grouprank``: a
worker's shards of the model stay its own). Otherwise it stops them (after the answer ``stop``, so that none
waits for the round) and starts new workers, as before.

Imports of ours: ``unbroken.env``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from unbroken.env import HANDOVER_HOLD as HOLD
from unbroken.env import HANDOVER_NEXT as NEXT
from unbroken.env import HANDOVER_READY as READY

logger = logging.getLogger(__name__)

NODE_LOST = "node_lost"
"""The failure cause of a node whose keep-alive expired (the agent's membership check)."""


@dataclass(frozen=True)
class Handed:
    """One worker handed over: its rank and pid in the new round, and what its environment
    changes (``env``: names set; ``unset``: names removed)."""

    rank: int
    pid: int
    env: dict[str, str]
    unset: list[str]


class Workers(Protocol):
    """What of ``workers.LocalWorkers`` a handover uses."""

    def running(self) -> list[int]: ...
    def handover_prefix(self, info: Any, local_rank: int) -> str | None: ...
    def hand_over(self, info: Any) -> tuple[dict[int, Handed] | None, list[Any]]: ...


class Handover:
    """This node's workers: paused for the next round, then handed over to it (or refused)."""

    def __init__(self, store: Callable[[], Any], workers: Workers, *, nproc: int) -> None:
        """``store()``: the agent's connection to the job store (it may be re-made)."""
        self.store = store
        self.workers = workers
        self.nproc = nproc
        self.paused: list[str] = []
        """The paused workers' prefixes, in local-rank order ([]: none paused)."""
        self._place = (-1, -1)  # the paused workers' (first rank, world size)

    def pause(self, info: Any, failures: Sequence[Any]) -> bool:
        """After lost nodes alone, pause every worker of round ``info`` (True) when every one
        runs and listens; False: stop them as before."""
        if not failures or any(f.cause != NODE_LOST for f in failures):
            return False
        running = self.workers.running()
        prefixes = [self.workers.handover_prefix(info, lr) for lr in sorted(running)]
        if len(running) != self.nproc or None in prefixes:
            logger.info("stopping the workers: %d of %d run", len(running), self.nproc)
            return False
        keys = [p for p in prefixes if p is not None]
        try:
            store = self.store()
            if not store.check([p + READY for p in keys]):
                logger.info("stopping the workers: they do not listen for a handover")
                return False
            value = json.dumps({"why": failures[0].message})
            store.multi_set([p + HOLD for p in keys], [value] * len(keys))
        except Exception as e:  # noqa: BLE001 - the store: stop the workers as before
            logger.warning("could not pause the workers for a handover (%s); stopping them", e)
            return False
        self.paused = keys
        self._place = (info.rank_offset, info.world_size)
        logger.info("the workers are paused for the next round")
        return True

    def hand_over(self, info: Any) -> tuple[dict[int, tuple[int, int]] | None, list[Any]]:
        """The paused workers become round ``info``'s: ``{local_rank: (rank, pid)}``, or None
        (refused: the caller stops them and starts new ones); second, the exits reaped."""
        if (info.rank_offset, info.world_size) != self._place:  # their shards moved
            self.refuse(f"this node's ranks moved (world size {info.world_size})")
            return None, []
        handed, exits = self.workers.hand_over(info)
        if handed is None:
            self.refuse("a worker of this node exited while paused")
            return None, exits
        try:
            store = self.store()
            for prefix, lr in zip(self.paused, sorted(handed), strict=True):
                h = handed[lr]
                store.set(prefix + NEXT, json.dumps({"env": h.env, "unset": h.unset}))
        except Exception as e:  # noqa: BLE001
            logger.warning("could not hand the workers over (%s); starting new ones", e)
            self.refuse(f"the handover failed: {e}")
            return None, exits
        self.paused = []
        return {lr: (h.rank, h.pid) for lr, h in handed.items()}, exits

    def refuse(self, why: str) -> None:
        """The paused workers are not handed over: they leave (the caller stops them)."""
        keys, self.paused = self.paused, []
        if not keys:
            return
        try:
            value = json.dumps({"stop": why})
            self.store().multi_set([p + NEXT for p in keys], [value] * len(keys))
        except Exception as e:  # noqa: BLE001 - they are stopped anyway
            logger.warning("could not tell the paused workers to leave: %s", e)
