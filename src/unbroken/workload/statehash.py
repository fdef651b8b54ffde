"""A canonical SHA-256 over nested state (dicts, lists, tensors, scalars).

Two states hash equal iff they have the same structure, keys, dtypes, shapes and bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "full_tensor"):  # a DTensor that was not gathered
            t = t.full_tensor()
        t = t.cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
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


def state_sha256(obj: Any) -> str:
    """Hex SHA-256 of ``obj`` in a canonical order."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()
