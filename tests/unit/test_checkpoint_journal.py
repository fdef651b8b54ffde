"""The journal of a rank's noted values: written per note, read back by the next process."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from unbroken.checkpoint.staging import journal
from unbroken.checkpoint.state.extras import RNG_KEY, RngState
from unbroken.checkpoint.state.resolve import PerRank

pytestmark = pytest.mark.unit


class Cursor:
    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def _state(model: torch.nn.Module) -> dict[str, object]:
    return {
        "model": model,
        "data": Cursor(7),
        "scale": torch.tensor([1.5, 2.5]),
        RNG_KEY: PerRank(RngState()),
    }


def test_a_note_s_values_come_back_in_another_process_s_state() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    model = torch.nn.Linear(2, 2)
    noted = _state(model)
    j = journal.Journal()
    try:
        assert j.write(12, noted, {"model"}), j.refused
        want = (torch.rand(3), random.random(), np.random.rand())  # what the noted RNG gives
        entry = journal.read(j.fd)
    finally:
        j.close()
    assert entry is not None and entry.step == 12
    assert set(entry.values) == {"data", "scale", RNG_KEY}
    live = {"model": model, "data": Cursor(0), "scale": torch.zeros(2), RNG_KEY: noted[RNG_KEY]}
    assert journal.can_apply(entry, live) is None
    journal.apply(entry, live)
    assert live["data"].pos == 7 and torch.equal(live["scale"], torch.tensor([1.5, 2.5]))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_a_torn_write_leaves_the_entry_before_it() -> None:
    j = journal.Journal()
    try:
        state = {"data": Cursor(1)}
        assert j.write(5, state, set())
        state["data"].pos = 2
        assert j.write(6, state, set())
        # Step 6 went to the other half: damage its payload (a process killed mid-write).
        with open(f"/proc/self/fd/{j.fd}", "r+b") as f:
            f.seek(0 + journal._HEAD.size + 3)
            f.write(b"\xff\xff")
        entry = journal.read(j.fd)
    finally:
        j.close()
    assert entry is not None and (entry.step, entry.values["data"][1]) == (5, {"pos": 1})


def test_values_that_cannot_be_set_in_place_or_held_are_refused() -> None:
    j = journal.Journal()
    try:
        assert not j.write(1, {"epoch": 3}, set())
        assert "plain value" in j.refused
        assert journal.read(j.fd) is None  # nothing written
        assert j.write(2, {"w": torch.ones(3)}, set())
        entry = journal.read(j.fd)
        assert entry is not None
        assert "does not fit" in (journal.can_apply(entry, {"w": torch.ones(4)}) or "")
        assert not j.write(2, {"blob": torch.zeros(journal.CAPACITY // 4 + 1)}, set())
        assert "bytes >" in j.refused
        assert not j.write(3, {"f": lambda: 0}, set())
        assert "cannot be journaled" in j.refused
    finally:
        j.close()


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_planted_journal_runs_no_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    j = journal.Journal()
    try:
        payload = pickle.dumps({"x": ("stateful", _Boom())})
        head = journal._HEAD.pack(
            journal._MAGIC, 9, len(payload), xxhash.xxh3_64_intdigest(payload), 1
        )
        with open(f"/proc/self/fd/{j.fd}", "r+b") as f:
            f.write(head + payload)
        assert journal.read(j.fd) is None
    finally:
        j.close()
    assert not (tmp_path / "PWNED").exists()


def test_tensors_of_any_dtype_and_shape_come_back_exactly() -> None:
    values = {
        "scalar": torch.tensor(1.5),
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "flags": torch.tensor([True, False]),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "empty": torch.zeros(0, 3),
    }
    j = journal.Journal()
    try:
        assert j.write(0, values, set()), j.refused
        entry = journal.read(j.fd)
    finally:
        j.close()
    assert entry is not None
    for key, want in values.items():
        kind, got = entry.values[key]
        assert kind == "tensor" and got.dtype == want.dtype and torch.equal(got, want), key


class _Shared:
    """A Stateful whose state dict is the same object while unchanged (as notes' generators)."""

    def __init__(self, sd: dict[str, object]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, object]:
        return self.sd

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.sd = sd


def test_an_unchanged_value_rewrites_the_header_and_the_next_change_the_other_half() -> None:
    words = tuple(range(625))
    same = _Shared({"t": torch.arange(4), "words": words, "inner": {"k": torch.ones(2)}})
    j = journal.Journal()
    try:
        assert j.write(5, {"g": same}, set())
        half = j._last[1]
        assert j.write(6, {"g": same}, set())  # the same objects: header only, same half
        assert j._last[1] == half
        entry = journal.read(j.fd)
        assert entry is not None and entry.step == 6
        got = entry.values["g"][1]
        assert torch.equal(got["t"], torch.arange(4)) and got["words"] == words
        assert torch.equal(got["inner"]["k"], torch.ones(2))
        # A new dict sharing the unchanged parts: the other half, whole even if 7 is torn.
        changed = _Shared({**same.sd, "t": torch.arange(4) * 2})
        assert j.write(7, {"g": changed}, set())
        assert j._last[1] != half
        entry = journal.read(j.fd)
        assert entry is not None and entry.step == 7
        assert torch.equal(entry.values["g"][1]["t"], torch.arange(4) * 2)
        assert entry.values["g"][1]["words"] == words
        with open(f"/proc/self/fd/{j.fd}", "r+b") as f:
            f.seek(j._last[1] + journal._HEAD.size + 5)
            f.write(b"\xff\xff")
        entry = journal.read(j.fd)
        assert entry is not None and entry.step == 6
    finally:
        j.close()


def test_values_equal_but_of_other_types_are_written_as_they_are() -> None:
    j = journal.Journal()
    try:
        assert j.write(1, {"c": Cursor(1)}, set())
        assert j.write(2, {"c": Cursor(1.0)}, set())  # 1 == 1.0: pickled again all the same
        entry = journal.read(j.fd)
    finally:
        j.close()
    assert entry is not None and type(entry.values["c"][1]["pos"]) is float
