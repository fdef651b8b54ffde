"""A digest of training state: what a benchmark compares across runs.

``state_sha256(obj)`` is a SHA-256 over nested state in a canonical order: each Stateful's
``state_dict()`` (a module, an optimizer, a ``PerRank`` value) or the value itself, mappings by
key, sequences by position, a tensor by its dtype, shape and bytes. Two states hash equal iff
they have the same structure, keys, dtypes, shapes and bytes. A DTensor counts as its full
tensor (a collective: call it on every rank), or with ``local=True`` as this rank's shard
(``local_digest``: no collective; two runs on the same world with the same sharding digest
equal exactly when every rank's state is bit-for-bit the same). ``Checkpointer.close`` records it when ``CheckpointConfig.final_digest``
asks (``UNBROKEN_FINAL_DIGEST=1``, set by ``unbroken bench recovery``), so that a script that
prints no hash of its own can still be checked for bit-exactness.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def _feed(h: Any, obj: Any, local: bool) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard, or gathered
            t = t.to_local() if local else t.full_tensor()  # type: ignore[attr-defined]
        t = t.cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif callable(getattr(obj, "state_dict", None)) and not isinstance(obj, Mapping):
        _feed(h, obj.state_dict(), local)
    elif hasattr(obj, "obj") and type(obj).__name__ == "PerRank":
        _feed(h, obj.obj, local)
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=str):
            h.update(f"K{key!s}:".encode())
            _feed(h, obj[key], local)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _feed(h, item, local)
        h.update(b"]")
    else:
        h.update(f"V{type(obj).__name__}:{obj!r};".encode())


def state_sha256(obj: Any, *, local: bool = False) -> str:
    """Hex SHA-256 of ``obj`` in a canonical order (see the module docstring).

    Args:
        obj: nested state: mappings, sequences, tensors, Statefuls, plain values.
        local: hash a DTensor's local shard (no collective) instead of its full tensor.

    Returns:
        64 hex digits.
    """
    h = hashlib.sha256()
    _feed(h, obj, local)
    return h.hexdigest()


def local_digest(state: Mapping[str, Any]) -> str:
    """``state_sha256(state, local=True)``: this rank's part, without a collective."""
    return state_sha256(state, local=True)
