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


def _full() -> tuple[object, dict]:
    """What the generators hold, read the slow, public way."""
    np_state = np.random.get_state(legacy=False)
    return random.getstate(), {
        "key": np_state["state"]["key"].astype(np.int64).tolist(),
        "pos": int(np_state["state"]["pos"]),
        "has_gauss": int(np_state["has_gauss"]),
        "gauss": float(np_state["gauss"]),
    }


def _same_as_full(state: dict) -> bool:
    py, np_state = _full()
    got = dict(state["numpy"], key=state["numpy"]["key"].tolist())
    return state["python"] == py and got == np_state


# Each move changes what a capture must see; some change no word of the generator (a cached
# Gaussian used up), which the raw-bytes shortcuts must still notice.
_MOVES = [
    lambda: None,
    lambda: random.random(),
    lambda: random.gauss(0, 1),  # draws two, caches one (gauss_next)
    lambda: random.gauss(0, 1),  # uses the cached one: no word moves
    lambda: np.random.rand(),
    lambda: np.random.randn(),  # draws two, caches one (has_gauss)
    lambda: np.random.randn(),  # uses the cached one: key and pos stay
    lambda: np.random.seed(7),
    lambda: random.seed(7),
    lambda: torch.rand(1),
]


@pytest.mark.parametrize("shortcuts", [True, False])
def test_every_capture_equals_the_full_read_after_every_kind_of_move(shortcuts: bool) -> None:
    from unbroken.checkpoint.state import rng

    if not shortcuts:  # as where the C layouts differ: the layout check turns them off
        for gen in (rng._PYTHON, rng._NUMPY):
            gen._layout_ok, gen._last = False, None
    try:
        random.seed(1)
        np.random.seed(1)
        noted = rng.NotedRng()
        for move in _MOVES * 2:
            move()
            before = noted._last
            state, note = capture_rng_state(), noted.capture()
            assert _same_as_full(state) and _same_as_full(note)
            assert torch.equal(note["torch"], torch.get_rng_state())
            if shortcuts and move is _MOVES[0] and before is not None:
                assert note is before  # nothing moved: the last note's own dict
            if move is _MOVES[-1]:
                assert note is not before
    finally:
        for gen in (rng._PYTHON, rng._NUMPY):
            gen._layout_ok, gen._last = None, None


def test_a_capture_holds_new_tensors_a_restore_may_load_into() -> None:
    a, b = capture_rng_state(), capture_rng_state()
    assert a["numpy"]["key"] is not b["numpy"]["key"]
    a["numpy"]["key"].zero_()  # as a DCP load into the state dict does
    assert _same_as_full(capture_rng_state())
