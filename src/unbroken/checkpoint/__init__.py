"""Asynchronous sharded checkpoints with atomic, verified commits.

Laid out by the life of a checkpoint, one subpackage per phase:

- ``state``: what a checkpoint holds, a training state as DCP write items and back as live
  objects (``resolve``, with what one save keeps for the next and the restore's shortcuts);
- ``staging``: a save's blocking part, the copy into the shared arena and the ring of
  snapshots it leaves there (``staging``, ``arena``, ``memory``, ``rescue``);
- ``persisting``: a save's background part, the writer process, the commit protocol and the
  fork server (its ``__init__`` walks through the save flow, module by module);
- ``tiers``: the memory tiers, an arena that outlives its process (``keeper``) and its node
  (``peers``), adopted by the next Checkpointer and restored from (``tiers``);
- ``restoring``: the restore from disk (its ``__init__`` walks through the restore flow);
- ``schedule``: when a durable save is due (``adaptive``, ``interval``).

At the top: ``Checkpointer`` (``checkpointer``: the save flow starts in its ``save``, the
restore flow in its ``restore``), its configuration and errors (``config``), the on-disk
layout with its checks and retention (``layout``: written by persisting, read by restoring,
staging's unpickler and fault injection, so it belongs to no one phase), and what
``unbroken.run`` offers a Checkpointer (``node``). ``config``, ``layout`` and ``node`` import
nothing else of the package. The phases import each other one way only: staging and
restoring build on state, tiers on staging and state, persisting on staging's arena alone,
schedule on persisting's statistics; none imports ``checkpointer``. Each subpackage's
docstring states its rule; ``tests/unit/test_layering.py`` checks them, and that no module
imports another's private name.

Imports torch. Names are loaded lazily so that the writer process (``python -m
unbroken.checkpoint.persisting.writer``) arms its parent-death signal before it imports torch;
no subpackage's ``__init__`` imports anything, and ``layout`` and ``persisting.hooks`` never
import torch (fault injection uses them). Imports of ours: ``unbroken.errors``,
``unbroken.env``, ``unbroken.log``, ``unbroken.ledger``, ``unbroken.mask``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.checkpoint.checkpointer import Checkpointer
    from unbroken.checkpoint.config import CheckpointConfig, CheckpointError, StorageFailed
    from unbroken.checkpoint.persisting.health import StorageStatus
    from unbroken.checkpoint.persisting.hooks import WriterHooks
    from unbroken.checkpoint.persisting.inflight import CheckpointStats
    from unbroken.checkpoint.state.digest import state_sha256
    from unbroken.checkpoint.state.resolve import PerRank

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointStats",
    "Checkpointer",
    "PerRank",
    "StorageFailed",
    "StorageStatus",
    "WriterHooks",
    "state_sha256",
]

_WHERE = {
    "Checkpointer": "checkpointer",
    "CheckpointStats": "persisting.inflight",
    "WriterHooks": "persisting.hooks",
    "CheckpointConfig": "config",
    "CheckpointError": "config",
    "PerRank": "state.resolve",
    "StorageFailed": "config",
    "StorageStatus": "persisting.health",
    "state_sha256": "state.digest",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"unbroken.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'unbroken.checkpoint' has no attribute {name!r}")
