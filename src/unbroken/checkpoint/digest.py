"""A digest of the state a rank holds: what a benchmark compares across runs.

``local_digest(state)`` is a SHA-256 over this rank's part of a training state, in a canonical
order: each entry's ``state_dict()`` (a Stateful: a module, an optimizer, a ``PerRank`` value)
or the value itself, nested mappings and sequences by key and position, a tensor by its dtype,
shape and bytes, a DTensor by its local shard (no collective: a rank hashes what it holds). Two
runs on the same world with the same sharding digest equal exactly when every rank's state is
bit-for-bit the same. ``Checkpointer.close`` records it when ``CheckpointConfig.final_digest``
asks (``UNBROKEN_FINAL_DIGEST=1``, set by ``unbroken bench recovery``), so that a script that
prints no hash of its own can still be checked for bit-exactness.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t = t.to_local()
        t = t.cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif callable(getattr(obj, "state_dict", None)) and not isinstance(obj, Mapping):
        _feed(h, obj.state_dict())
    elif hasattr(obj, "obj") and type(obj).__name__ == "PerRank":
        _feed(h, obj.obj)
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=str):
            h.update(f"K{key!s}:".encode())
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(f"V{type(obj).__name__}:{obj!r};".encode())


def local_digest(state: Mapping[str, Any]) -> str:
    """Hex SHA-256 of this rank's part of ``state`` (see the module docstring)."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()
