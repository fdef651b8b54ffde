"""Asynchronous sharded checkpoints with atomic, verified commits.

Owns: resolving a training state into DCP write items (``resolve``; ``savecache`` and
``reuse``: what one save keeps for the next), the shared staging arena
and the copy into it (``arena``, ``staging``), the save in flight and its persistent per-rank
writer process (``inflight``, ``writer``, ``client``, ``protocol``; ``forkserver``: the small
copy of the trainer ``unbroken.run`` forks writers from), the hooks fault injection
and tests hand that process (``hooks``), the on-disk layout, commit protocol and retention
(``layout``, ``commit``), restore and the memory tier (``restore``, ``memory``, ``tiers``, and
``keeper``: the worker's side of the node agent's hold on its arena; ``node``: the keeper and
peers ``unbroken.run`` offers to a Checkpointer).
``Checkpointer`` (``checkpointer``) ties them together.

Imports torch. Names are loaded lazily so that the writer process (``python -m
unbroken.checkpoint.writer``) arms its parent-death signal before it imports torch; ``layout``
and ``hooks`` never import torch (fault injection uses them). Imports of ours:
``unbroken.errors``, ``unbroken.env``, ``unbroken.log``, ``unbroken.ledger``, ``unbroken.mask``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.checkpoint.checkpointer import Checkpointer
    from unbroken.checkpoint.config import CheckpointConfig, CheckpointError
    from unbroken.checkpoint.digest import state_sha256
    from unbroken.checkpoint.hooks import WriterHooks
    from unbroken.checkpoint.inflight import CheckpointStats
    from unbroken.checkpoint.resolve import PerRank

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointStats",
    "Checkpointer",
    "PerRank",
    "WriterHooks",
    "state_sha256",
]

_WHERE = {
    "Checkpointer": "checkpointer",
    "CheckpointStats": "inflight",
    "WriterHooks": "hooks",
    "CheckpointConfig": "config",
    "CheckpointError": "config",
    "PerRank": "resolve",
    "state_sha256": "digest",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"unbroken.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'unbroken.checkpoint' has no attribute {name!r}")
