"""A framework's own state (loop counters, schedulers, generators) as one value in a
Checkpointer's state: its shape is known only once the framework runs, so it is serialized
whole (``torch.save``), not a tree a restore would need a template of, and loaded
``weights_only`` (tensors, containers, numbers, strings: a checkpoint may come from a peer's
memory)."""

from __future__ import annotations

import io
from typing import Any

import torch


def dumps(value: Any) -> bytes:
    """``value`` serialized with ``torch.save``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """What ``dumps`` wrote, loaded ``weights_only``."""
    return torch.load(io.BytesIO(data), weights_only=True)
