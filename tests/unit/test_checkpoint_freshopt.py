"""A fresh optimizer restored from an in-memory snapshot: its state made from what the snapshot
holds (``freshopt``), not by DCP's zero-grad step, bit for bit, for plain and FSDP2 (DTensor)
parameters; DCP's path where that does not apply, and a Mismatch where nothing fits."""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import groups
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.staging import memory
from unbroken.checkpoint.state import freshopt
from unbroken.ledger import Ledger
from unbroken.workload.model import SIZES, build_model, loss_fn
from unbroken.workload.parallel import wrap_model


@pytest.fixture
def gloo_group() -> Iterator[None]:
    with groups.gloo_group():
        yield


def _build(parallel: str, optim_cls: Any = torch.optim.AdamW) -> tuple[Any, Any]:
    model = wrap_model(build_model(SIZES["tiny"], seed=0), parallel=parallel, device="cpu")
    return model, optim_cls(model.parameters(), lr=3e-3, weight_decay=0.1)


def _train(model: Any, optim: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, SIZES["tiny"].vocab_size, (2, 16), generator=gen)
        loss_fn(model(x), x).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same(a: Any, b: Any) -> bool:
    """Same parameters and optimizer state: bytes, dtypes, DTensor-ness, key order."""
    ma, mb = a[0].state_dict(), b[0].state_dict()
    if list(ma) != list(mb) or not all(torch.equal(_local(ma[k]), _local(mb[k])) for k in ma):
        return False
    sa, sb = a[1].state_dict(), b[1].state_dict()
    if sa["param_groups"] != sb["param_groups"] or list(sa["state"]) != list(sb["state"]):
        return False
    for pid, st in sa["state"].items():
        other = sb["state"][pid]
        if list(st) != list(other):
            return False
        for k, v in st.items():
            w = other[k]
            if type(v) is not type(w) or v.dtype != w.dtype or v.device != w.device:
                return False
            if not torch.equal(_local(v), _local(w)):
                return False
    return True


def _snapshot(tmp_path: Path, model: Any, optim: Any) -> memory.Snapshot:
    """Stage ``model``/``optim`` in memory and return the snapshot a restart would find."""
    led = Ledger(tmp_path, run="t", rank=0)
    ck = Checkpointer(tmp_path / "ckpt", ledger=led, every_steps=100, snapshot_every=1)
    ck.maybe_save(0, {"model": model, "optim": optim})
    ck.wait_staged()
    ck.abort()  # keeps the arena for this process's next Checkpointer
    led.close()
    arena = memory.take((tmp_path / "ckpt").resolve())
    assert arena is not None
    memory.keep((tmp_path / "ckpt").resolve(), arena)
    [snap, *_] = memory.read(arena)[1]
    return snap


def _steps_taken(optim: Any) -> list[int]:
    calls: list[int] = []
    optim.register_step_pre_hook(lambda *_: calls.append(1))
    return calls


def _restore_and_compare(tmp_path: Path, parallel: str) -> None:
    ref = _build(parallel)
    _train(*ref, steps=3, seed=1)
    snap = _snapshot(tmp_path, *ref)
    fresh = _build(parallel)
    steps = _steps_taken(fresh[1])
    pending = memory.prepare({"model": fresh[0], "optim": fresh[1]}, snap, rank=0)
    assert pending.plan.fresh == {"optim"}
    pending.apply()
    assert steps == []  # no zero-grad step ran
    assert _same(ref, fresh)
    _train(*ref, steps=2, seed=2)
    _train(*fresh, steps=2, seed=2)
    assert _same(ref, fresh)  # and trains on identically
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_fresh_optimizer_gets_the_snapshot_bit_for_bit(tmp_path: Path) -> None:
    _restore_and_compare(tmp_path, "none")


@pytest.mark.slow
def test_fsdp2_dtensor_state_is_made_like_its_parameters(gloo_group: None, tmp_path: Path) -> None:
    _restore_and_compare(tmp_path, "fsdp")
    model, optim = _build("fsdp")
    _train(model, optim, steps=1, seed=0)
    st = next(iter(optim.state.values()))
    assert isinstance(st["exp_avg"], DTensor) and not isinstance(st["step"], DTensor)


def test_an_optimizer_with_state_keeps_dcps_path(tmp_path: Path) -> None:
    ref = _build("none")
    _train(*ref, steps=2, seed=1)
    snap = _snapshot(tmp_path, *ref)
    live = _build("none")
    _train(*live, steps=1, seed=3)  # has state already: DCP loads into it
    pending = memory.prepare({"model": live[0], "optim": live[1]}, snap, rank=0)
    assert pending.plan.fresh == set()
    pending.apply()
    assert _same(ref, live)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_custom_optimizer_over_dtensors_keeps_dcps_path(gloo_group: None, tmp_path: Path) -> None:
    class MyAdam(torch.optim.AdamW):
        pass

    MyAdam.__module__ = "somewhere.else"
    ref = _build("fsdp", MyAdam)
    _train(*ref, steps=2, seed=1)
    snap = _snapshot(tmp_path, *ref)
    fresh = _build("fsdp", MyAdam)
    steps = _steps_taken(fresh[1])
    pending = memory.prepare({"model": fresh[0], "optim": fresh[1]}, snap, rank=0)
    assert pending.plan.fresh == set() and steps == [1]  # DCP's zero-grad step
    pending.apply()
    assert _same(ref, fresh)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


def test_a_snapshot_of_another_shape_is_a_mismatch(tmp_path: Path) -> None:
    ref = _build("none")
    _train(*ref, steps=1, seed=1)
    snap = _snapshot(tmp_path, *ref)
    other = torch.nn.Linear(3, 3)
    optim = torch.optim.AdamW(other.parameters())
    before = other.weight.detach().clone()
    with pytest.raises(memory.Mismatch, match="live torch.float32"):
        memory.prepare({"model": other, "optim": optim}, snap, rank=0)
    assert torch.equal(other.weight, before)
    wider = build_model(dataclasses.replace(SIZES["tiny"], vocab_size=640), seed=0)
    optim = torch.optim.AdamW(wider.parameters(), lr=3e-3, weight_decay=0.1)
    with pytest.raises(memory.Mismatch, match=r"\(640, 128\)"):
        memory.prepare({"model": wider, "optim": optim}, snap, rank=0)
    assert not optim.state and all(p.grad is None for p in wider.parameters())  # untouched
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


def test_parameters_in_another_order_are_mapped_by_name(tmp_path: Path) -> None:
    ref = _build("none")
    _train(*ref, steps=2, seed=1)
    snap = _snapshot(tmp_path, *ref)
    model = build_model(SIZES["tiny"], seed=0)  # the same parameters, in reverse order
    reordered = torch.optim.AdamW(list(model.parameters())[::-1], lr=3e-3, weight_decay=0.1)
    memory.prepare({"model": model, "optim": reordered}, snap, rank=0).apply()
    by_name = dict(model.named_parameters())
    want = {n: ref[1].state[p]["exp_avg"] for n, p in ref[0].named_parameters()}
    assert all(torch.equal(reordered.state[by_name[n]]["exp_avg"], want[n]) for n in want)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


@pytest.mark.parametrize("parallel", ["none", "fsdp"])
@pytest.mark.slow
def test_a_disk_restore_makes_the_state_the_same_way(
    gloo_group: None, tmp_path: Path, parallel: str
) -> None:
    ref = _build(parallel)
    _train(*ref, steps=2, seed=1)
    with Checkpointer(tmp_path / "ckpt", every_steps=1, memory_tier=False) as ck:
        ck.save(1, {"model": ref[0], "optim": ref[1]})
    fresh = _build(parallel)
    steps = _steps_taken(fresh[1])
    with Checkpointer(tmp_path / "ckpt", memory_tier=False) as ck:
        assert ck.restore({"model": fresh[0], "optim": fresh[1]}) == 1
    assert steps == [] and _same(ref, fresh)
    _train(*ref, steps=1, seed=2)
    _train(*fresh, steps=1, seed=2)
    assert _same(ref, fresh)


def _pooled_restore(tmp_path: Path, size: int | None) -> tuple[Any, Any, freshopt.Pool]:
    """A fresh model/optimizer restored from a snapshot of ``ref`` with the state carved from
    a pool of ``size`` bytes (None: as much as the snapshot needs)."""
    ref = _build("none")
    _train(*ref, steps=3, seed=1)
    snap = _snapshot(tmp_path, *ref)
    saved = freshopt.Saved(tensors={i.fqn: (s.dtype, s.shape) for i, s in snap.tensors}, values=())
    pool = freshopt.Pool(freshopt.spare_bytes(saved) if size is None else size)
    pool.fault_in()
    fresh = _build("none")
    with freshopt.carving(pool):
        pending = memory.prepare({"model": fresh[0], "optim": fresh[1]}, snap, rank=0)
    pool.close()
    pending.apply()
    assert _same(ref, fresh)
    _train(*ref, steps=2, seed=2)
    _train(*fresh, steps=2, seed=2)
    assert _same(ref, fresh)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]
    return ref, fresh, pool


@pytest.mark.slow
def test_the_state_is_carved_from_the_warmed_pool_one_storage_per_tensor(tmp_path: Path) -> None:
    _, (_, optim), pool = _pooled_restore(tmp_path, None)
    tensors = [v for st in optim.state.values() for k, v in st.items() if k != "step"]
    assert pool.carved == len(tensors) > 0  # every one of them from the pool
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    big = max(tensors, key=lambda t: t.numel())
    buf = io.BytesIO()
    torch.save(big, buf)  # writes its own bytes, not the pool's
    assert buf.tell() < big.numel() * big.element_size() + 4096


@pytest.mark.slow
def test_a_pool_too_small_leaves_the_rest_to_fresh_memory(tmp_path: Path) -> None:
    _, (_, optim), pool = _pooled_restore(tmp_path, 4096)
    tensors = [v for st in optim.state.values() for k, v in st.items() if k != "step"]
    assert 0 < pool.carved < len(tensors)


@pytest.mark.slow
def test_load_hooks_keep_the_full_load(tmp_path: Path) -> None:
    ref = _build("none")
    _train(*ref, steps=3, seed=1)
    snap = _snapshot(tmp_path, *ref)
    fresh = _build("none")
    seen: list[str] = []
    fresh[0].register_load_state_dict_pre_hook(lambda *_a, **_k: seen.append("model"))
    fresh[1].register_load_state_dict_post_hook(lambda *_a: seen.append("optim"))
    pending = memory.prepare({"model": fresh[0], "optim": fresh[1]}, snap, rank=0)
    assert memory._loaded_in_place(pending.plan, []) is None  # a hook: load_state_dict runs
    pending.apply()
    assert seen == ["model", "optim"] and _same(ref, fresh)
    plain = _build("none")
    pending = memory.prepare({"model": plain[0], "optim": plain[1]}, snap, rank=0)
    assert memory._loaded_in_place(pending.plan, []) == "model"  # the copy loaded it
    pending.apply()
    assert _same(ref, plain)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


def test_state_copied_ahead_into_the_pool_is_not_copied_again(tmp_path: Path) -> None:
    ref = _build("none")
    _train(*ref, steps=3, seed=1)
    snap = _snapshot(tmp_path, *ref)
    saved = freshopt.Saved(tensors={i.fqn: (s.dtype, s.shape) for i, s in snap.tensors}, values=())
    pool = freshopt.Pool(freshopt.spare_bytes(saved))
    ahead = [(s, snap.arena.view(s)) for i, s in snap.tensors if s.shape and ".state." in i.fqn]
    pool.fill(ahead)  # what tiers.Warm does while the new process builds its model
    fresh = _build("none")
    with freshopt.carving(pool):
        pending = memory.prepare({"model": fresh[0], "optim": fresh[1]}, snap, rank=0)
    skipped: list[Any] = []

    def done(dst: torch.Tensor, slot: Any) -> bool:
        if pool.tag_of(dst) == slot:
            skipped.append(slot)
            return True
        return False

    pending.apply(done=done)
    assert len(skipped) == len(ahead) == pool.carved > 0
    assert _same(ref, fresh)
    # Copied ahead from another snapshot (another tag): copied again, from this one.
    stale = freshopt.Pool(pool.size)
    stale.fill([(("older", s), torch.zeros_like(t)) for s, t in ahead])
    other = _build("none")
    with freshopt.carving(stale):
        pending = memory.prepare({"model": other[0], "optim": other[1]}, snap, rank=0)
    pending.apply(done=lambda dst, slot: stale.tag_of(dst) == slot)
    assert stale.carved == len(ahead) and _same(ref, other)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


def test_a_pool_is_left_out_of_a_child_forked_before_the_restore_ends() -> None:
    pool = freshopt.Pool(1 << 20)
    pool.fault_in()
    t = pool.take((1024,), torch.float32)
    assert t is not None
    t.fill_(3.0)

    def child_reads() -> int:
        pid = os.fork()
        if pid == 0:  # the checkpoint writer never reads the state: the arena holds its copy
            faulthandler.disable()  # a quiet SIGSEGV
            os._exit(0 if float(t[0]) == 3.0 else 2)
        return os.waitpid(pid, 0)[1]

    status = child_reads()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    pool.close()
    assert child_reads() == 0  # after the restore the state forks like any memory
    assert float(t[0]) == 3.0
