"""A large snapshot is sealed on the stager thread (``staging.SEAL_LATER_BYTES``): its digests
leave the save's stall, and whatever reads the region still finds it sealed: an abort right
after the save hands the memory tier a snapshot that restores bit for bit. A small one is
sealed in the save."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import CheckpointConfig, Checkpointer
from unbroken.checkpoint.staging import memory, staging
from unbroken.ledger import Ledger, read_events


class _Flat(torch.nn.Module):
    def __init__(self, nbytes: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.rand(nbytes // 4, generator=g), requires_grad=False)


@pytest.mark.parametrize(
    ("nbytes", "later"), [(staging.SEAL_LATER_BYTES + (4 << 20), True), (1 << 20, False)]
)
def test_a_large_snapshot_is_sealed_after_the_save_and_before_anything_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, later: bool
) -> None:
    sealed_on: list[str] = []
    seal = memory.seal

    def spy(*args: object, **kwargs: object) -> None:
        sealed_on.append(threading.current_thread().name)
        seal(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(memory, "seal", spy)
    root = tmp_path / "ckpt"
    model = _Flat(nbytes, seed=0)
    led = Ledger(tmp_path, run="t", rank=0)
    ck = Checkpointer(root, ledger=led, every_steps=1)
    ck.save(0, {"model": model})
    ck.abort()  # at once: the stager's seal comes first, then the arena goes to the memory tier
    assert len(sealed_on) == 1
    assert sealed_on[0].startswith("unbroken-ckpt-stager") is later, sealed_on

    restored = _Flat(nbytes, seed=1)
    assert not torch.equal(restored.w, model.w)
    with Checkpointer(root, ledger=led, every_steps=1) as ck2:
        assert ck2.restore({"model": restored}) == 0
    assert torch.equal(restored.w, model.w)
    led.close()
    [load] = [e for e in read_events(tmp_path) if e.kind == "ckpt_load"]
    assert (load.get("tier"), load.get("source")) == ("memory", "process")


@pytest.mark.parametrize("big", [True, False])
def test_a_large_arena_is_laid_out_on_the_stager_thread_before_the_first_save(
    tmp_path: Path, big: bool
) -> None:
    """At the first ``maybe_save`` that is no save, a large state's arena is allocated and
    faulted in on the stager thread: the first save copies, it does not allocate. A small
    state's waits for its first save, as before."""
    nbytes = staging.SEAL_LATER_BYTES + (4 << 20) if big else 1 << 20
    model = _Flat(nbytes, seed=0)
    led = Ledger(tmp_path, run="t", rank=0)
    no_snapshots = CheckpointConfig(every_steps=3, snapshot_budget=0.0)
    ck = Checkpointer(tmp_path / "ckpt", ledger=led, config=no_snapshots)
    assert not ck.maybe_save(0, {"model": model})  # no save: the arena laid out meanwhile
    ck.wait_staged()
    ahead = ck.staging_bytes
    assert (ahead >= nbytes) is big and (ahead == 0) is not big
    ck.maybe_save(1, {"model": model})
    assert ck.maybe_save(2, {"model": model})  # the first save
    assert ck.wait()
    # The first save used the arena laid out ahead, or allocated its own.
    assert ck.staging_bytes >= nbytes and (ck.staging_bytes == ahead) is big
    ck.close()
    led.close()
    stages = [e for e in read_events(tmp_path) if e.kind == "ckpt_stage"]
    [save] = [e for e in stages if e.get("part") is None]
    assert save.get("step") == 2
    restored = _Flat(nbytes, seed=1)
    with Checkpointer(tmp_path / "ckpt", memory_tier=False) as ck2:
        assert ck2.restore({"model": restored}) == 2
    assert torch.equal(restored.w, model.w)
