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
mid-write leaves the other half whole. The payload is one part per value: [length][pickle of
(key, kind, skeleton)][raw bytes of each of its tensors and arrays, in order]; the skeleton is
the value with every CPU tensor and numpy array replaced by a ``_Slot`` (dtype and shape). A
value that is the same object as at the last note (the generators while none moved: ``rng``)
reuses its part, a skeleton that did not change its pickle, and an entry whose every part is
reused rewrites only the header. Read back with an unpickler that builds nothing else than
plain values and slots.
"""

from __future__ import annotations

import io
import logging
import math
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


_LEN = struct.Struct("<Q")
_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None)})


class _Slot:
    """Where a tensor (``kind`` "t": a torch dtype's name) or a numpy array ("a": a dtype
    string) sits in a skeleton; its bytes follow the skeleton in slot order."""

    __slots__ = ("kind", "dtype", "shape")

    def __init__(self, kind: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.kind, self.dtype, self.shape = kind, dtype, shape

    def __eq__(self, other: object) -> bool:
        return type(other) is _Slot and (self.kind, self.dtype, self.shape) == (
            other.kind,
            other.dtype,
            other.shape,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return _Slot, (self.kind, self.dtype, self.shape)

    def nbytes(self) -> int:
        size = (
            _torch_dtype(self.dtype).itemsize if self.kind == "t" else np.dtype(self.dtype).itemsize
        )
        return size * math.prod(self.shape)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"no torch dtype {name!r}")
    return dtype


class _Split:
    """Values -> (skeleton, raw buffers). The tuples and dicts of the last split (``known``)
    that are the same objects again (a note's values are never changed in place: the
    generators' while none moved) give their skeleton and buffers without a walk."""

    def __init__(self, known: dict[int, tuple[Any, Any, list[memoryview]]]) -> None:
        self.raw: list[memoryview] = []
        self.known = known
        self.seen: dict[int, tuple[Any, Any, list[memoryview]]] = {}

    def __call__(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _PLAIN:
            return obj
        if kind is tuple or kind is dict:
            memo = self.known.get(id(obj))
            if memo is not None and memo[0] is obj:
                self.seen[id(obj)] = memo
                self.raw.extend(memo[2])
                return memo[1]
            begin = len(self.raw)
            if kind is dict:
                skeleton: Any = {k: self(v) for k, v in obj.items()}
            elif all(type(x) in _PLAIN for x in obj):
                skeleton = obj
            else:
                skeleton = tuple(map(self, obj))
            self.seen[id(obj)] = (obj, skeleton, self.raw[begin:])
            return skeleton
        if kind is list:
            return obj[:] if all(type(x) in _PLAIN for x in obj) else list(map(self, obj))
        if isinstance(obj, torch.Tensor):
            plain = type(obj) in (torch.Tensor, torch.nn.Parameter)
            if obj.device.type != "cpu" or obj.layout != torch.strided or not plain:
                raise TypeError(f"a {type(obj).__name__} on {obj.device} is not journaled")
            t = obj.detach().contiguous()
            self.raw.append(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else _NONE)
            return _Slot("t", str(t.dtype).removeprefix("torch."), tuple(t.shape))
        if kind is np.ndarray:
            if obj.dtype.hasobject:
                raise TypeError("a numpy array of objects is not journaled")
            a = np.ascontiguousarray(obj)
            self.raw.append(a.reshape(-1).view(np.uint8).data if a.size else _NONE)
            return _Slot("a", a.dtype.str, a.shape)
        if isinstance(obj, Mapping):
            return {k: self(v) for k, v in obj.items()}
        if (kind is set or kind is frozenset) and all(type(x) in _PLAIN for x in obj):
            return obj
        raise TypeError(f"a {kind.__name__} is not journaled")


_NONE = memoryview(b"")


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` pickle alike: equal, and of the same types throughout (``1 == 1.0 ==
    True``, ``0.0 == -0.0``: a skeleton that only compares equal is pickled again)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if kind is tuple or kind is list:
        if len(a) != len(b):
            return False
        if all(type(x) in _PLAIN for x in a):  # a generator's words: compared in C
            return a == b and list(map(type, a)) == list(map(type, b))
        return all(map(_same, a, b))
    if kind is float:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)


def _fill(skeleton: Any, buf: memoryview, offset: list[int]) -> Any:
    """``skeleton`` with each slot replaced by its tensor or array read from ``buf``."""
    kind = type(skeleton)
    if kind is _Slot:
        n = skeleton.nbytes()
        raw = bytearray(buf[offset[0] : offset[0] + n])
        offset[0] += n
        if skeleton.kind == "a":
            return np.frombuffer(raw, dtype=np.dtype(skeleton.dtype)).reshape(skeleton.shape)
        dtype = _torch_dtype(skeleton.dtype)
        if not n:
            return torch.empty(skeleton.shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).reshape(skeleton.shape)
    if kind is dict:
        return {k: _fill(v, buf, offset) for k, v in skeleton.items()}
    if kind is list or (kind is tuple and any(type(x) not in _PLAIN for x in skeleton)):
        return kind(_fill(v, buf, offset) for v in skeleton)
    return skeleton


_ALLOWED = {
    (__name__, "_Slot"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
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


@dataclass
class _Part:
    """One value's encoding: its pickled (key, kind, skeleton) and the raw bytes of its slots."""

    value: Any
    skeleton: Any
    blob: bytes
    raw: list[memoryview]
    known: dict[int, tuple[Any, Any, list[memoryview]]]

    @property
    def nbytes(self) -> int:
        return _LEN.size + len(self.blob) + sum(r.nbytes for r in self.raw)


class Journal:
    """This rank's journal: a memfd of two halves, written by ``write``; the keeper holds it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("unbroken-journal", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 2 * _HALF)
        self._map = mmap.mmap(self.fd, 2 * _HALF)
        self._seq = 0
        self._parts: dict[str, _Part] = {}
        self._last: tuple[list[_Part], int, int, int] | None = None
        """The last entry written: its parts, half, payload length and digest."""
        self.refused = ""
        """Why the last note was not journaled ("" when it was)."""

    def _part(self, key: str, kind: str, value: Any) -> _Part:
        """``value``'s encoding: the last one while ``value`` is the same object (a note's
        generators while none moved), its pickle again only when its skeleton changed."""
        last = self._parts.get(key)
        if last is not None and last.value is value:
            return last
        split = _Split(last.known if last is not None else {})
        skeleton = (key, kind, split(value))
        if last is not None and _same(skeleton, last.skeleton):
            blob = last.blob
        else:
            blob = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        part = _Part(value, skeleton, blob, split.raw, split.seen)
        self._parts[key] = part
        return part

    def write(self, step: int, state: Mapping[str, Any], skip: Collection[str]) -> bool:
        """Journal ``step``'s values of ``state`` (a note's); False (``refused`` says why)
        when they cannot be held."""
        try:
            parts = [self._part(k, kind, v) for k, (kind, v) in encode(state, skip).items()]
        except Exception as e:  # noqa: BLE001 - a value it cannot hold costs the catch-up only
            self._parts.clear()
            self.refused = f"a value cannot be journaled ({type(e).__name__}: {e})"
            return False
        self._seq += 1
        m, last = self._map, self._last
        if last is not None and len(parts) == len(last[0]) and all(map(_is, parts, last[0])):
            # The same payload as the last entry's: only its header changes (torn by a kill,
            # the other half's older entry is read, if there is one).
            _, base, length, digest = last
        else:
            length = sum(p.nbytes for p in parts)
            if length > CAPACITY:
                self.refused = f"the values take {length} bytes > {CAPACITY}"
                return False
            base = _HALF - last[1] if last is not None else _HALF  # the other half
            m[base : base + _HEAD.size] = bytes(_HEAD.size)  # cleared first
            at = base + _HEAD.size
            for part in parts:
                chunks: tuple[bytes | memoryview, ...] = (_LEN.pack(len(part.blob)), part.blob)
                for chunk in (*chunks, *part.raw):
                    m[at : at + len(chunk)] = chunk
                    at += len(chunk)
            with memoryview(m) as view:
                digest = xxhash.xxh3_64_intdigest(view[base + _HEAD.size : at])
        m[base : base + _HEAD.size] = _HEAD.pack(_MAGIC, step, length, digest, self._seq)
        self._last = (parts, base, length, digest)
        self.refused = ""
        return True

    def close(self) -> None:
        self._parts.clear()
        self._last = None
        self._map.close()
        os.close(self.fd)


def _is(a: object, b: object) -> bool:
    return a is b


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
            raw = m[base + _HEAD.size : base + _HEAD.size + length]
            if xxhash.xxh3_64_intdigest(raw) != digest:
                continue
            if best is None or seq > best[0]:
                best = (seq, step, raw)
    if best is None:
        return None
    values: dict[str, tuple[str, Any]] = {}
    try:
        payload, at = memoryview(best[2]), [0]
        while at[0] < len(payload):
            (length,) = _LEN.unpack_from(payload, at[0])
            begin = at[0] + _LEN.size
            key, kind, skeleton = _Unpickler(io.BytesIO(payload[begin : begin + length])).load()
            at[0] = begin + length
            values[key] = (kind, _fill(skeleton, payload, at))
    except Exception as e:  # whole by its digest: another version wrote it
        logger.warning("journal unreadable: %s", e)
        return None
    return Entry(step=best[1], values=values)


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
