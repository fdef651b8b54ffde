"""Capture and restore every RNG a training step may touch, for bit-exact resumption.

The captured state holds only tensors and plain Python objects (ints, floats, tuples, lists,
dicts, None), so it survives ``torch.save`` and ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The torch CPU, CUDA (every visible device; empty if none), Python and numpy RNG states.

    Every tensor and container in it is new (a restore may load into them in place): a caller
    may keep it without copying."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": _PYTHON.capture(),
        "numpy": _NUMPY.capture(),
    }


class NotedRng:
    """The generators' states for notes, taken every step: the last one again (the same
    object) while no generator moved, so that a note and its journal entry cost little more
    than the check. Its values are shared between notes: only read, never loaded into."""

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None
        self._bytes = b""  # the last capture's torch and CUDA states, for the comparison
        self._cuda = torch.cuda.is_available()

    def capture(self) -> dict[str, Any]:
        """``capture_rng_state``'s values, or the last capture's dict if they are equal."""
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if self._cuda else []
        py, np_state = _PYTHON.capture(), _NUMPY.capture(shared=True)
        raw = b"".join([cpu.numpy().tobytes(), *(c.numpy().tobytes() for c in cuda)])
        last = self._last
        same = last is not None and py is last["python"] and np_state is last["numpy"]
        if last is not None and same and raw == self._bytes:
            return last
        self._last = {"torch": cpu, "cuda": cuda, "python": py, "numpy": np_state}
        self._bytes = raw
        return self._last


class _NumpyGlobal:
    """numpy's global generator's state, read in full only when it may have changed.

    A full read (``get_state``) copies the 624-word key a word at a time, several times the
    rest of a capture. The key and position are read instead as raw bytes from the bit
    generator's state struct (``BitGenerator.ctypes.state_address``); when they equal those of
    the last full read and that read held no cached Gaussian, the state is unchanged (only a
    draw moves the position or caches a Gaussian) and the last read is returned. A cached
    Gaussian can be used up without a draw, so a state holding one is always read in full.
    ``restore_rng_state`` forgets the last read. The raw layout (``uint32 key[624]; int pos``)
    is checked against a full read; where it differs the shortcut is off.

    A script that calls ``np.random.set_state`` with a state equal to the current one but for
    its cached Gaussian is the one case the shortcut cannot see.
    """

    _RAW = 624 * 4 + 4

    def __init__(self) -> None:
        self._last: tuple[Any, bytes, dict[str, Any]] | None = None
        self._layout_ok: bool | None = None

    def _raw(self, bits: Any) -> bytes | None:
        if self._layout_ok is False:
            return None
        try:
            return ctypes.string_at(bits.ctypes.state_address, self._RAW)
        except (AttributeError, TypeError, ValueError):
            self._layout_ok = False
            return None

    def capture(self, *, shared: bool = False) -> dict[str, Any]:
        """The state (``shared``: the last read's own dict while unchanged, else a copy)."""
        bits = np.random.mtrand._rand._bit_generator
        raw = self._raw(bits)
        last = self._last
        if raw is not None and last is not None and last[0] is bits and last[1] == raw:
            return last[2] if shared else {**last[2], "key": last[2]["key"].clone()}
        np_state = np.random.get_state(legacy=False)
        assert isinstance(np_state, dict) and np_state["bit_generator"] == "MT19937", np_state
        key = np_state["state"]["key"]
        pos = int(np_state["state"]["pos"])
        state: dict[str, Any] = {
            # uint32 key as int64: a dtype every torch version saves and loads.
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": pos,
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
        if raw is not None and self._layout_ok is None:
            self._layout_ok = raw == key.astype("<u4").tobytes() + pos.to_bytes(4, "little")
        if raw is not None and self._layout_ok and not state["has_gauss"]:
            self._last = (bits, raw, {**state, "key": state["key"].clone()})
            return self._last[2] if shared else state
        self._last = None
        return state

    def forget(self) -> None:
        """Read the state in full at the next capture."""
        self._last = None


class _PythonGlobal:
    """Python's global generator's state (``random.getstate``), the last one again while
    unchanged.

    ``getstate`` builds a new 625-int tuple every call, which a note then also journals. The
    generator's 624 words and index are compared instead as raw bytes read from the C object
    (``_random.Random``: the object header, ``int index``, ``uint32_t state[624]``), with its
    ``gauss_next``: when both equal the last read, that read's tuple (immutable) is returned,
    and a journal that held it already knows it. The layout is checked against ``getstate``
    once; where it differs (another interpreter build) every capture calls ``getstate``.
    """

    _RAW = 4 + 624 * 4

    def __init__(self) -> None:
        self._last: tuple[Any, bytes, Any, Any] | None = None
        self._layout_ok: bool | None = None

    def _raw(self, gen: Any) -> bytes | None:
        if self._layout_ok is False or type(gen).__basicsize__ < object.__basicsize__ + self._RAW:
            return None
        return ctypes.string_at(id(gen) + object.__basicsize__, self._RAW)

    def capture(self) -> Any:
        gen = random._inst  # what random.getstate reads
        raw, gauss = self._raw(gen), getattr(gen, "gauss_next", None)
        last = self._last
        same_words = raw is not None and last is not None and last[0] is gen and last[1] == raw
        if same_words and last is not None and (last[2] is gauss or last[2] == gauss):
            return last[3]
        state = gen.getstate()
        if raw is not None and self._layout_ok is None:
            words = state[1]
            want = struct.pack("<i", words[-1]) + struct.pack(f"<{len(words) - 1}I", *words[:-1])
            self._layout_ok = raw == want
        self._last = (gen, raw, state[2], state) if raw is not None and self._layout_ok else None
        return state


_NUMPY = _NumpyGlobal()
_PYTHON = _PythonGlobal()


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``capture_rng_state`` returned; later draws repeat the captured ones.

    CUDA states are restored for the devices both the capture and this process see; a count
    mismatch is logged, not fatal (a rank usually draws on one device only).
    """
    missing = {"torch", "cuda", "python", "numpy"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)}; keys seen: {sorted(state)}")
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = list(state["cuda"])
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            logger.warning(
                "RNG state holds %d CUDA states but %d devices are visible; restoring %d",
                len(cuda_states),
                count,
                min(count, len(cuda_states)),
            )
        for device, cuda_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(cuda_state.cpu(), device)
    elif cuda_states:
        logger.warning("RNG state holds CUDA states but CUDA is not available; skipped")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    key = np.asarray(np_state["key"].cpu().numpy(), dtype=np.uint32)
    np.random.set_state(
        ("MT19937", key, int(np_state["pos"]), int(np_state["has_gauss"]), float(np_state["gauss"]))
    )
    _NUMPY.forget()
