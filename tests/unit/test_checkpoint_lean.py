"""One snapshot per rank in memory (``memory_slots`` 1, the default): the arena's memory is one
copy of the state; a rescue takes a spare region, whose memory is given back once the next
snapshot replaces the one in region 0; a save or snapshot while the save in region 0 persists
is held back (the step noted instead) until that save is done."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from toy import mlp, train_step
from unbroken.checkpoint import CheckpointConfig, Checkpointer, layout
from unbroken.checkpoint.staging import memory
from unbroken.ledger import Ledger, read_events


def _allocated(root: Path) -> int:
    """Bytes of memory the arena kept for ``root`` takes (put back for the next Checkpointer)."""
    arena = memory.take(root.resolve())
    assert arena is not None
    try:
        return os.fstat(arena.fd).st_blocks * 512
    finally:
        memory.keep(root.resolve(), arena)


def _state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values()) + [
        t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_one_copy_in_memory_a_rescue_spare_given_back_at_the_next_snapshot(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="t", rank=0)
    root = tmp_path / "ckpt"
    model, optim = mlp(0, hidden=16384)  # 4 MB of state: the arena's pages are mostly it
    state = {"model": model, "optim": optim}
    ck = Checkpointer(root, ledger=led, every_steps=100, snapshot_every=2, overlap=True)
    assert ck.config.lean
    for step in range(5):  # snapshots of steps 1 and 3, notes of 2 and 4
        train_step(model, optim)
        ck.maybe_save(step, state)
    ck.wait_staged()
    size = _state_bytes(model, optim)
    model(torch.randn(8, 16)).pow(2).sum().backward()  # the next step, then a fault
    ck.abort()  # rescues step 4 into the spare region
    arena = memory.take(root.resolve())
    assert arena is not None
    assert [s.step for s in memory.read(arena)[1]] == [4, 3]
    memory.keep(root.resolve(), arena)
    two = _allocated(root)
    assert 1.8 * size < two < 2.5 * size, (two, size)  # the snapshot and the rescue
    model2, optim2 = mlp(1, hidden=16384)
    state2 = {"model": model2, "optim": optim2}
    ck2 = Checkpointer(root, ledger=led, every_steps=100, snapshot_every=2, overlap=True)
    assert ck2.restore(state2) == 4
    for step in range(5, 8):  # a snapshot of step 5 into region 0 gives the spare back
        train_step(model2, optim2)
        ck2.maybe_save(step, state2)
    ck2.wait_staged()
    ck2.abort()
    one = _allocated(root)
    assert 0.9 * size < one < 1.4 * size, (one, size)
    arena = memory.take(root.resolve())
    assert arena is not None
    assert [s.step for s in memory.read(arena)[1]] == [7]  # step 7 noted, rescued (no change)
    arena.close()
    led.close()


@pytest.mark.parametrize(
    ("hidden", "mbps"),
    [
        (2048, 0.5),  # 0.4 MB of state, sealed in the save
        (200_000, 40.0),  # 40 MB, sealed on the stager thread (staging.SEAL_LATER_BYTES)
    ],
)
def test_a_save_while_the_last_one_persists_from_its_region_waits_for_it_then_is_staged(
    tmp_path: Path, hidden: int, mbps: float
) -> None:
    led = Ledger(tmp_path, run="t", rank=0)
    root = tmp_path / "ckpt"
    big = hidden > 2048
    model, optim = mlp(0, hidden=hidden)
    state = {"model": model, "optim": optim}
    slow = CheckpointConfig(throttle_mbps=mbps, snapshot_budget=0.0)  # persists for a second
    ck = Checkpointer(root, ledger=led, every_steps=2, config=slow)
    staged = []
    for step in range(4):
        train_step(model, optim)
        staged.append(ck.maybe_save(step, state))
    assert staged == [False, True, False, False]  # step 3's save: step 1's still persists
    assert ck.wait()  # step 1 durable
    train_step(model, optim)
    assert ck.maybe_save(4, state)  # the save held back, staged at the next step
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert ck.wait()
    ck.close()
    assert layout.committed_steps(root) == [4, 1]
    stages = [e for e in read_events(tmp_path) if e.kind == "ckpt_stage"]
    # The large arena, laid out ahead on the stager thread at step 0, is waited for by step 1's
    # save only where that thread had not finished it (a busy machine): then before that save.
    waits = ("seal", "prepare")
    parts = [(e.get("step"), e.get("part")) for e in stages if e.get("part") not in waits]
    assert parts == [(0, "note"), (1, None), (2, "note"), (3, "agree"), (3, "note"), (4, None)]
    prepared = [i for i, e in enumerate(stages) if e.get("part") == "prepare"]
    first = next(i for i, e in enumerate(stages) if e.get("step") == 1 and not e.get("part"))
    assert prepared in ([], [first - 1]) if big else not prepared, (prepared, first)
    # A large snapshot's seal after the save: waited for (blocking) where it was still running.
    assert {e.get("step") for e in stages if e.get("part") == "seal"} <= ({1, 4} if big else set())
    model2, optim2 = mlp(1, hidden=hidden)
    with Checkpointer(root, ledger=led, memory_tier=False) as ck2:
        assert ck2.restore({"model": model2, "optim": optim2}) == 4
    assert all(torch.equal(v, want[k]) for k, v in model2.state_dict().items())
    led.close()
