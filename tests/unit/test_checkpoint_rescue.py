"""The rescue: a step noted between snapshots is snapshotted by the ``abort`` of a fault that
leaves the model and optimizers as that step left them, and never when anything it would hold
changed since (an optimizer step, a replaced parameter, a hyperparameter, a buffer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from toy import mlp, train_step
from unbroken.checkpoint import Checkpointer, PerRank
from unbroken.checkpoint.staging.rescue import _freeze
from unbroken.ledger import Ledger, read_events


class _Cursor:
    """A Stateful whose state dict hands out its live list and tensor (no copies)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.acc = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "acc": self.acc}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = list(state["seen"])
        self.acc = state["acc"].clone()


def _run(
    tmp_path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer, *, rescue: bool = True
) -> Any:
    """Steps 0-4 through ``maybe_save`` (a snapshot after step 2, notes after the others), and
    what the state was after step 4."""
    cursor = _Cursor()
    state = {"model": model, "optim": optim, "cursor": cursor, "rng": PerRank(_Cursor())}
    led = Ledger(tmp_path, run="t", rank=0)
    ck = Checkpointer(
        tmp_path / "ckpt",
        ledger=led,
        every_steps=100,
        snapshot_every=3,
        overlap=True,
        rescue=rescue,
    )
    for step in range(5):
        train_step(model, optim)
        cursor.seen.append(step)
        cursor.acc += step
        staged = ck.maybe_save(step, state)
        assert staged == (step == 2)
    want = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {
            k: {n: t.clone() for n, t in s.items()} for k, s in optim.state_dict()["state"].items()
        },
    }
    cursor.seen.append(5)  # the interrupted step's data cursor, in place
    cursor.acc += 5
    return ck, led, want


def _restore(tmp_path: Path, led: Ledger) -> tuple[int | None, Any, Any, _Cursor]:
    model, optim = mlp(7)
    cursor = _Cursor()
    state = {"model": model, "optim": optim, "cursor": cursor, "rng": PerRank(_Cursor())}
    with Checkpointer(tmp_path / "ckpt", ledger=led, every_steps=100, snapshot_every=3) as ck:
        step = ck.restore(state)
    led.close()
    return step, model, optim, cursor


def _interrupted_forward(model: torch.nn.Module) -> None:
    """The next step's forward and backward, then the fault (no optimizer step)."""
    model(torch.randn(8, 16)).pow(2).sum().backward()


def test_a_fault_before_the_optimizer_step_rescues_the_noted_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, optim = mlp(0)
    ck, led, want = _run(tmp_path, model, optim)
    _interrupted_forward(model)
    ck.abort()
    step, model2, optim2, cursor = _restore(tmp_path, led)
    assert step == 4
    assert all(torch.equal(v, want["model"][k]) for k, v in model2.state_dict().items())
    got = optim2.state_dict()["state"]
    assert all(torch.equal(t, want["optim"][k][n]) for k, s in got.items() for n, t in s.items())
    assert cursor.seen == [0, 1, 2, 3, 4]  # as noted, not as changed in place after
    assert torch.equal(cursor.acc, torch.full((3,), 10.0))
    stages = [e for e in read_events(tmp_path) if e.kind == "ckpt_stage"]
    assert [e.get("step") for e in stages if e.get("part") is None] == [2, 4]
    # Every step neither saved nor snapshotted was noted, from the first (its resolve learned
    # what a note tracks), and its time is a save's blocking time (checkpoint cost in the
    # ledger), not a step's.
    notes = [e for e in stages if e.get("part") == "note"]
    assert [e.get("step") for e in notes] == [0, 1, 3, 4]
    assert all(e.dur_s is not None and e.dur_s > 0 for e in notes)


def test_without_rescue_nothing_is_noted_and_a_fault_keeps_the_last_snapshot(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model, optim = mlp(0)
    ck, led, _ = _run(tmp_path, model, optim, rescue=False)
    _interrupted_forward(model)
    ck.abort()
    assert _restore(tmp_path, led)[0] == 2
    stages = [e for e in read_events(tmp_path) if e.kind == "ckpt_stage"]
    assert not [e for e in stages if e.get("part") == "note"]


@pytest.mark.parametrize("change", ["optimizer step", "replaced parameter", "learning rate"])
def test_a_change_after_the_note_keeps_the_last_snapshot(tmp_path: Path, change: str) -> None:
    torch.manual_seed(0)
    model, optim = mlp(0)
    ck, led, _ = _run(tmp_path, model, optim)
    if change == "optimizer step":
        train_step(model, optim)
    elif change == "replaced parameter":
        model[0].bias = torch.nn.Parameter(model[0].bias.detach().clone())
    else:
        optim.param_groups[0]["lr"] = 0.01
    ck.abort()
    assert _restore(tmp_path, led)[0] == 2


def test_a_model_with_buffers_is_never_noted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="unbroken.checkpoint.save")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = {"model": model, "optim": optim}
    ck = Checkpointer(tmp_path / "ckpt", every_steps=100, snapshot_every=3, overlap=True)
    assert not ck.note(0, state)  # nothing resolved yet
    assert ck._saves.notes.refused == "no save has been resolved yet"
    for step in range(4):
        model(torch.randn(8, 16)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
        ck.maybe_save(step, state)
    assert not ck.note(3, state)
    assert "buffers" in ck._saves.notes.refused
    # Said once, once the state was resolved (before that, refusing is no news).
    told = [r.getMessage() for r in caplog.records if "not noted" in r.getMessage()]
    assert told == [
        "rank 0: steps between snapshots are not noted (the model has buffers (not tracked by "
        "version counters)): a fault restores the last snapshot"
    ]
    model(torch.randn(8, 16))  # BatchNorm's running statistics change, no version bump
    ck.abort()
    with Checkpointer(tmp_path / "ckpt") as ck2:
        assert ck2.restore(state) == 2


def test_freeze_copies_containers_and_tensors_and_refuses_other_objects() -> None:
    live = {"a": [1, 2], "t": torch.ones(2), "n": (1, [3]), "s": "x"}
    frozen = _freeze(live)
    live["a"].append(3)
    live["t"].add_(1)
    live["n"][1].append(4)
    assert frozen["a"] == [1, 2] and frozen["n"] == (1, [3]) and frozen["s"] == "x"
    assert torch.equal(frozen["t"], torch.ones(2))
    with pytest.raises(Exception, match="a object"):
        _freeze({"o": object()})


class _Wrapped:
    """A model and optimizer behind one Stateful (as a framework's wrappers hold them)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])


def test_a_state_without_a_model_is_not_noted_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="unbroken.checkpoint.save")
    model, optim = mlp(0)
    state = {"wrapped": _Wrapped(model, optim)}
    with Checkpointer(tmp_path / "ckpt", every_steps=2, snapshot_every=0) as ck:
        for step in range(4):
            train_step(model, optim)
            ck.maybe_save(step, state)
        assert ck._saves.notes.note is None
    told = [r.getMessage() for r in caplog.records if "not noted" in r.getMessage()]
    assert told == [
        "rank 0: steps between snapshots are not noted (the state holds no nn.Module and "
        "optimizers whose tensors a save tracks): a fault restores the last snapshot"
    ]


def test_a_fault_before_the_first_save_rescues_its_step(tmp_path: Path) -> None:
    """``maybe_save`` resolves the state at its first step, so the steps before the first save
    (at step 99 here) are noted, and a fault rescues the newest: no restart from scratch."""
    torch.manual_seed(0)
    model, optim = mlp(0)
    state = {"model": model, "optim": optim}
    led = Ledger(tmp_path, run="t", rank=0)
    ck = Checkpointer(tmp_path / "ckpt", ledger=led, every_steps=100)
    for step in range(4):
        train_step(model, optim)
        assert not ck.maybe_save(step, state)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _interrupted_forward(model)
    ck.abort()
    model2, optim2 = mlp(7)
    with Checkpointer(tmp_path / "ckpt", ledger=led, every_steps=100) as ck2:
        assert ck2.restore({"model": model2, "optim": optim2}) == 3
    led.close()
    assert all(torch.equal(v, want[k]) for k, v in model2.state_dict().items())
