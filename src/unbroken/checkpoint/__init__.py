"""Asynchronous sharded checkpoints with atomic, verified commits.

Owns: resolving a training state into DCP write items (``resolve``), the shared staging arena
(``arena``), the persistent per-rank writer process (``writer``, ``client``, ``protocol``), the
on-disk layout, commit protocol and retention (``layout``, ``commit``), restore
(``restore``), and the slow-storage fault's control files the writer obeys (``throttle``). ``Checkpointer`` (``checkpointer``) ties them together.

Imports torch, ``unbroken.ledger`` (event kinds) and ``unbroken.errors``; nothing else of ours.
Names are loaded lazily so that the writer process (``python -m unbroken.checkpoint.writer``)
arms its parent-death signal before it imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.checkpoint.checkpointer import Checkpointer, CheckpointStats
    from unbroken.checkpoint.config import CheckpointConfig, CheckpointError
    from unbroken.checkpoint.resolve import PerRank

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointStats", "Checkpointer", "PerRank"]

_WHERE = {
    "Checkpointer": "checkpointer",
    "CheckpointStats": "checkpointer",
    "CheckpointConfig": "config",
    "CheckpointError": "config",
    "PerRank": "resolve",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"unbroken.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'unbroken.checkpoint' has no attribute {name!r}")
