"""unbroken: keeps PyTorch distributed training productive through faults.

The public API. Importing ``unbroken`` does not import torch: names that need it load on
first use. A training script wraps its loop in ``run`` (or ``main``, which also exits with the
right code), calls ``ctx.step_done`` after each step and saves through a ``Checkpointer`` (its
less common settings in a ``CheckpointConfig``); see ``unbroken.job``. The exceptions it may
see: ``Escalated`` (exit with its ``exit_code``, 75: the launcher takes over), ``RankExcluded``
(``exit_code`` 0: this rank left the job), ``CheckpointError`` (restarted in-process like any
error of ``fn``), all ``UnbrokenError``.

Imports of ours: ``unbroken.errors``, ``unbroken.version``, ``unbroken.env``, ``unbroken.ledger``,
``unbroken.checkpoint``, ``unbroken.restart``, ``unbroken.launcher.client``, ``unbroken.job``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from unbroken.errors import UnbrokenError
from unbroken.version import __version__

if TYPE_CHECKING:
    from unbroken.checkpoint import CheckpointConfig, Checkpointer, CheckpointError, PerRank
    from unbroken.job import main, run
    from unbroken.launcher.client import heartbeat
    from unbroken.restart import Escalated, RankExcluded, RestartConfig, RestartContext


__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "Escalated",
    "PerRank",
    "RankExcluded",
    "RestartConfig",
    "RestartContext",
    "UnbrokenError",
    "__version__",
    "heartbeat",
    "main",
    "run",
]

_LAZY = {
    "Checkpointer": "unbroken.checkpoint",
    "CheckpointConfig": "unbroken.checkpoint",
    "CheckpointError": "unbroken.checkpoint",
    "PerRank": "unbroken.checkpoint",
    "Escalated": "unbroken.restart",
    "RankExcluded": "unbroken.restart",
    "RestartConfig": "unbroken.restart",
    "RestartContext": "unbroken.restart",
    "main": "unbroken.job",
    "run": "unbroken.job",
    "heartbeat": "unbroken.launcher.client",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
