"""The per-rank values of each noted step, in memory the node agent keeps past a SIGKILL.

A note (``rescue``) holds a step's model and optimizers by reference and the state's other
values (the generators, a data cursor, counters) by value, all in the process. A SIGKILL takes
them with it. When the model and optimizers are replicated over the ranks (data parallel), a
surviving rank still holds them at that step and rescues it (the launcher gives it a moment),
but the values only the killed rank held are gone. The journal keeps them: each note writes
them into a small memfd that the node agent holds as it holds the arena (``keeper``), and the
next process of the rank reads them back. A restore then takes the step's model and optimizers
from a rank that holds it and these values from the journal (``tiers.catchup``).

Layout: two halves, written in turn, each [header: magic, step, payload length, xxh3 of the
payload, sequence][payload]; the header is written after the payload, so a process killed
mid-write leaves the other half whole. The payload is a pickle in which CPU tensors and numpy
arrays travel as raw bytes (a note's generators in tens of microseconds), read back with an
unpickler that builds nothing else than plain values, tensors and arrays.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import pickle
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from unbroken.checkpoint.state.resolve import PerRank, is_stateful

logger = logging.getLogger(__name__)

CAPACITY = 1 << 20
"""Payload bytes per half: a note's values larger than this are not journaled."""
_HEAD = struct.Struct("<8sqQQQ")  # magic, step, payload length, its xxh3, sequence
_MAGIC = b"UNBJRNL1"
_HALF = _HEAD.size + CAPACITY


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _array(raw: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.is_sparse:
            t = obj.detach()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _tensor, (raw, t.dtype, tuple(t.shape))
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            return _array, (obj.tobytes(), obj.dtype.str, obj.shape)
        return NotImplemented


_ALLOWED = {
    (__name__, "_tensor"),
    (__name__, "_array"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a journal holds no {module}.{name}")


@dataclass(frozen=True)
class Entry:
    """A noted step's values: key -> (kind, value), kind "stateful" (its state dict) or
    "tensor"."""

    step: int
    values: dict[str, tuple[str, Any]]


def encode(state: Mapping[str, Any], skip: Collection[str]) -> dict[str, tuple[str, Any]]:
    """The values of a note's frozen ``state`` other than ``skip`` (the model and optimizers).

    Raises:
        TypeError: For a plain value (a number, a dict): a restore cannot set it in place."""
    values: dict[str, tuple[str, Any]] = {}
    for key, value in state.items():
        if key in skip:
            continue
        value = value.obj if isinstance(value, PerRank) else value
        if is_stateful(value):
            values[key] = ("stateful", value.state_dict())
        elif isinstance(value, torch.Tensor):
            values[key] = ("tensor", value)
        else:
            raise TypeError(f"{key!r} is a plain value, which a restore cannot set in place")
    return values


class Journal:
    """This rank's journal: a memfd of two halves, written by ``write``; the keeper holds it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("unbroken-journal", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 2 * _HALF)
        self._map = mmap.mmap(self.fd, 2 * _HALF)
        self._seq = 0
        self.refused = ""
        """Why the last note was not journaled ("" when it was)."""

    def write(self, step: int, state: Mapping[str, Any], skip: Collection[str]) -> bool:
        """Journal ``step``'s values of ``state`` (a note's); False (``refused`` says why)
        when they cannot be held."""
        try:
            buf = io.BytesIO()
            _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(encode(state, skip))
        except Exception as e:  # noqa: BLE001 - a value it cannot hold costs the catch-up only
            self.refused = f"a value cannot be journaled ({type(e).__name__}: {e})"
            return False
        payload = buf.getbuffer()
        if len(payload) > CAPACITY:
            self.refused = f"the values take {len(payload)} bytes > {CAPACITY}"
            return False
        self._seq += 1
        base = (self._seq % 2) * _HALF
        self._map[base : base + _HEAD.size] = bytes(_HEAD.size)  # cleared first
        self._map[base + _HEAD.size : base + _HEAD.size + len(payload)] = payload
        head = _HEAD.pack(_MAGIC, step, len(payload), xxhash.xxh3_64_intdigest(payload), self._seq)
        self._map[base : base + _HEAD.size] = head
        self.refused = ""
        return True

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


def read(fd: int) -> Entry | None:
    """The newest whole entry of the journal memfd ``fd`` (not closed), or None."""
    size = os.fstat(fd).st_size
    if size < 2 * _HALF:
        return None
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        best: tuple[int, int, bytes] | None = None
        for base in (0, _HALF):
            magic, step, length, digest, seq = _HEAD.unpack_from(m, base)
            if magic != _MAGIC or length > CAPACITY:
                continue
            payload = m[base + _HEAD.size : base + _HEAD.size + length]
            if xxhash.xxh3_64_intdigest(payload) != digest:
                continue
            if best is None or seq > best[0]:
                best = (seq, step, payload)
    if best is None:
        return None
    try:
        raw = _Unpickler(io.BytesIO(best[2])).load()
    except Exception as e:  # whole by its digest: another version wrote it
        logger.warning("journal unreadable: %s", e)
        return None
    return Entry(step=best[1], values=raw)


def apply(entry: Entry, state: Mapping[str, Any]) -> None:
    """Load ``entry``'s values into the live ``state`` (``can_apply`` said it can)."""
    for key, (kind, value) in entry.values.items():
        live = state[key]
        live = live.obj if isinstance(live, PerRank) else live
        if kind == "stateful":
            live.load_state_dict(value)
        else:
            with torch.no_grad():
                live.copy_(value)


def can_apply(entry: Entry, state: Mapping[str, Any]) -> str | None:
    """None when ``apply`` can load ``entry`` into ``state``, else why not."""
    for key, (kind, value) in entry.values.items():
        if key not in state:
            return f"the state has no {key!r}"
        live = state[key]
        live = live.obj if isinstance(live, PerRank) else live
        if kind == "stateful" and not is_stateful(live):
            return f"{key!r} is no longer a Stateful"
        if kind == "tensor" and (not isinstance(live, torch.Tensor) or live.shape != value.shape):
            return f"{key!r} does not fit the live tensor"
    return None
