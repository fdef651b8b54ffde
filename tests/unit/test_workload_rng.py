import io
import random

import numpy as np
import pytest
import torch

from unbroken.checkpoint.state.rng import capture_rng_state, restore_rng_state


def _draw() -> tuple[torch.Tensor, float, np.ndarray, float]:
    return torch.rand(5), random.random(), np.random.rand(5), np.random.randn()


def test_round_trip_through_a_checkpoint() -> None:
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    np.random.randn()  # leave a cached Gaussian in numpy's state
    state = capture_rng_state()
    first = _draw()
    buf = io.BytesIO()
    torch.save({"rng": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["rng"]
    _draw()  # move every stream on
    restore_rng_state(loaded)
    second = _draw()
    assert torch.equal(first[0], second[0])
    assert first[1] == second[1]
    assert np.array_equal(first[2], second[2])
    assert first[3] == second[3]
    # And without restoring, the draws differ.
    third = _draw()
    assert not torch.equal(first[0], third[0])


def test_restore_rejects_incomplete_state() -> None:
    state = capture_rng_state()
    del state["numpy"]
    with pytest.raises(ValueError, match="numpy"):
        restore_rng_state(state)
