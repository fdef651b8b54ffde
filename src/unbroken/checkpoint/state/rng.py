"""Capture and restore every RNG a training step may touch, for bit-exact resumption.

The captured state holds only tensors and plain Python objects (ints, floats, tuples, lists,
dicts, None), so it survives ``torch.save`` and ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The torch CPU, CUDA (every visible device; empty if none), Python and numpy RNG states."""
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict) and np_state["bit_generator"] == "MT19937", np_state
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {
            # uint32 key as int64: a dtype every torch version saves and loads.
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }


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
