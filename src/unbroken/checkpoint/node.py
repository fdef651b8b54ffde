"""What the node a process runs on offers a Checkpointer: the agent's memory keeper, the peers.

``unbroken-run`` hands its workers the address of the node agent's memory keeper and, in a
multi-node job, every node's peer memory service (``unbroken.env.WorkerEnv``). ``unbroken.run``
provides them here (``provide``) while the training function runs, so that a user's own
``Checkpointer(dir, every_steps=...)`` gets the memory tiers that survive its process and its
node without naming them, as it gets the active ledger. Those fields given as keywords, or set
in its ``config`` (other than their defaults), win over what the node offers (``config.merged``).
Outside ``unbroken.run`` (or under another launcher) the node offers nothing. One per process;
set from the main thread. ``unbroken.run`` also offers what it knows of the job (``JobOffer``:
the environment's overrides, which it reads, and whether the process was relaunched).

``unbroken.run`` also says how a Checkpointer waits for a commit (``waiting``: in ``close``,
``wait``, a sync save, a save waiting for the last): a region without progress for a reason
the job knows, so neither the hang watchdog nor the launcher's steady timeout counts it (a
user's ``ckpt.close()`` after the loop needs no ``ctx.no_hang_protection()`` of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from unbroken.env import Overrides


@dataclass(frozen=True, kw_only=True)
class NodeTiers:
    """The node's memory tiers, as ``CheckpointConfig`` fields."""

    memory_keeper: str = ""
    """The node agent's memory keeper ("": none; see ``CheckpointConfig.memory_keeper``)."""
    peers: tuple[str, ...] = ()
    """Every node's peer memory service, in node order (see ``CheckpointConfig.peers``)."""
    peer_index: int = -1
    """This node's position in ``peers``."""

    def fields(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The config fields the node fills in, leaving those in ``given`` alone. The peers
        and their index go together: naming either keeps both out."""
        out: dict[str, Any] = {}
        if self.memory_keeper and "memory_keeper" not in given:
            out["memory_keeper"] = self.memory_keeper
        if self.peers and not {"peers", "peer_index"} & set(given):
            out["peers"], out["peer_index"] = self.peers, self.peer_index
        return out


_current = NodeTiers()


def current() -> NodeTiers:
    """What this process's node offers (nothing outside ``unbroken.run``)."""
    return _current


@contextmanager
def provide(tiers: NodeTiers) -> Iterator[None]:
    """Offer ``tiers`` to the Checkpointers built in the enclosed block (nests)."""
    global _current
    previous, _current = _current, tiers
    try:
        yield
    finally:
        _current = previous


@dataclass(frozen=True, kw_only=True)
class JobOffer:
    """What ``unbroken.run`` tells every Checkpointer of the job it runs (never read from the
    environment here: the checkpoint package reads none)."""

    overrides: Overrides = field(default_factory=Overrides)
    """The environment's overrides, which win over a Checkpointer's arguments
    (``config.overridden``)."""
    relaunched: bool = False
    """This process replaces one that failed (a launcher restart)."""


_job = JobOffer()


def job() -> JobOffer:
    """What ``unbroken.run`` offers about the job (nothing outside it)."""
    return _job


@contextmanager
def provide_job(offer: JobOffer) -> Iterator[None]:
    """Offer ``offer`` to the Checkpointers built in the enclosed block (nests)."""
    global _job
    previous, _job = _job, offer
    try:
        yield
    finally:
        _job = previous


Waiting = Callable[[], AbstractContextManager[None]]
_waiting: Waiting = nullcontext


def waiting() -> AbstractContextManager[None]:
    """The region of a wait for a commit, as ``unbroken.run`` provides it (else nothing)."""
    return _waiting()


@contextmanager
def provide_waiting(region: Waiting) -> Iterator[None]:
    """Make ``region()`` the region of every commit wait in the enclosed block (nests)."""
    global _waiting
    previous, _waiting = _waiting, region
    try:
        yield
    finally:
        _waiting = previous
