"""unbroken: keeps PyTorch distributed training productive through faults.

The public API. Importing ``unbroken`` does not import torch: names that need it load on
first use. Each name is re-exported from the package that owns it. Imports of ours:
``unbroken.errors``, ``unbroken.version``, ``unbroken.env``, ``unbroken.ledger``, ``unbroken.checkpoint``,
``unbroken.restart``, ``unbroken.launcher.client``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from unbroken.errors import UnbrokenError
from unbroken.version import __version__

if TYPE_CHECKING:
    from unbroken.checkpoint import Checkpointer, CheckpointError, PerRank
    from unbroken.launcher.client import heartbeat
    from unbroken.restart import RestartConfig, RestartContext, run


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "PerRank",
    "RestartConfig",
    "RestartContext",
    "UnbrokenError",
    "__version__",
    "heartbeat",
    "run",
]

_LAZY = {
    "Checkpointer": "unbroken.checkpoint",
    "CheckpointError": "unbroken.checkpoint",
    "PerRank": "unbroken.checkpoint",
    "RestartConfig": "unbroken.restart",
    "RestartContext": "unbroken.restart",
    "run": "unbroken.restart",
    "heartbeat": "unbroken.launcher.client",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
