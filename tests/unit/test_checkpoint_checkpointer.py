"""The Checkpointer in one process with its real writer process, real files and fsync."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from toy import mlp, train_step
from unbroken.checkpoint import CheckpointConfig, Checkpointer, PerRank, layout
from unbroken.checkpoint.staging import staging as staging_mod
from unbroken.faults import throttle
from unbroken.ledger import Ledger, read_events
from unbroken.ledger import events as ev


class Cursor:
    """A Stateful with plain values, like a data sampler."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "tag": "cursor"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return mlp(seed, inputs=32, hidden=64)


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in optim.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _throttled(mbps: float) -> CheckpointConfig:
    """A writer capped at ``mbps`` MB/s: emulated slow storage."""
    return CheckpointConfig(throttle_mbps=mbps)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the raw dcp.load below
@pytest.mark.parametrize("overlap", [False, True])
def test_a_checkpoint_holds_the_values_at_save_time(
    tmp_path: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if overlap:  # make the background copy slow, so only the optimizer hook protects it
        real_copy = staging_mod.copy_tensors

        def slow_copy(srcs: Any, dsts: Any) -> None:
            if threading.current_thread().name.startswith("unbroken-ckpt-stager"):
                time.sleep(0.3)
            real_copy(srcs, dsts)

        monkeypatch.setattr(staging_mod, "copy_tensors", slow_copy)
    led = Ledger(tmp_path, run="t", rank=0)
    model, optim = _model(0)
    cursor, extra = Cursor(), torch.arange(6.0)
    state = {"model": model, "optim": optim, "data": cursor, "extra": extra}
    train_step(model, optim)
    with Checkpointer(tmp_path / "ckpt", ledger=led, overlap=overlap) as ck:
        cursor.position = 40
        expected = _snapshot(model, optim)
        assert ck.save(7, state)
        # Training goes on at once: every value changes right after save returns.
        train_step(model, optim)
        extra.add_(100.0)
        cursor.position = 41
        assert not _same(_snapshot(model, optim), expected)
        ck.wait()
        assert ck.latest() == 7
        stats = ck.stats()
    assert stats.saves == 1 and stats.committed == 1 and len(stats.persist_s) == 1

    model2, optim2 = _model(1)
    cursor2, extra2 = Cursor(), torch.zeros(6)
    with Checkpointer(tmp_path / "ckpt", ledger=led, eager_writer=False) as ck:
        step = ck.restore({"model": model2, "optim": optim2, "data": cursor2, "extra": extra2})
        assert ck.writer_pid is None  # a restore-only Checkpointer starts no writer
    led.close()
    assert step == 7
    assert _same(_snapshot(model2, optim2), expected)
    assert cursor2.position == 40 and torch.equal(extra2, torch.arange(6.0))

    # The directory is a plain DCP checkpoint.
    plain = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(plain, checkpoint_id=layout.step_dir(tmp_path / "ckpt", 7), no_dist=True)
    assert all(torch.equal(plain["model"][k], expected[f"m.{k}"]) for k in plain["model"])

    kinds = [e.kind for e in read_events(tmp_path)]
    for kind in (ev.CKPT_STAGE, ev.CKPT_PERSIST, ev.CKPT_COMMIT, ev.CKPT_LOAD):
        assert kind in kinds, kind
    stage = next(e for e in read_events(tmp_path) if e.kind == ev.CKPT_STAGE)
    assert stage.get("step") == 7 and stage.get("bytes") > 0 and stage.get("staging_bytes") > 0
    assert stage.get("rss_bytes") > 0 and stage.get("queue_depth") == 0
    load = next(e for e in read_events(tmp_path) if e.kind == ev.CKPT_LOAD)
    assert (load.get("step"), load.get("tier")) == (7, "disk")


@pytest.mark.slow
def test_skip_policy_drops_a_save_while_one_persists_and_wait_blocks(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="t", rank=0)
    big = {"w": torch.randn(1 << 20)}  # 4 MiB at 8 MB/s: ~0.5 s to persist
    with Checkpointer(tmp_path / "skip", ledger=led, config=_throttled(8.0)) as ck:
        assert ck.save(1, big)
        assert ck.last_committed is None  # staged, not yet durable
        assert not ck.save(2, big)  # still persisting step 1
        ck.wait()
        assert ck.stats().skipped == 1 and ck.latest() == 1
        assert ck.last_committed == 1  # what the launcher's no-progress guard is told
    with Checkpointer(tmp_path / "wait", ledger=led, config=_throttled(8.0), on_busy="wait") as ck:
        assert ck.save(1, big)
        assert ck.save(2, big)
        stats = ck.stats()
        ck.wait()
        assert layout.committed_steps(tmp_path / "wait") == [2, 1]
    led.close()
    assert stats.skipped == 0 and stats.stall_s[1] > 0.2  # waited for step 1, as blocking
    skips = [e for e in read_events(tmp_path) if e.kind == ev.CKPT_SKIP]
    assert [(e.get("step"), "step 1" in e.get("reason")) for e in skips] == [(2, True)]
    waited = [e for e in read_events(tmp_path) if e.kind == ev.CKPT_STAGE and e.get("step") == 2]
    assert (
        waited and waited[-1].get("wait_s") > 0.2 and waited[-1].dur_s >= waited[-1].get("wait_s")
    )


def test_a_writer_death_fails_its_save_at_once_and_the_next_attempt_starts_another(
    tmp_path: Path,
) -> None:
    led = Ledger(tmp_path, run="t", rank=0)
    big, small = {"w": torch.randn(1 << 20)}, {"w": torch.arange(1000.0)}
    config = CheckpointConfig(throttle_mbps=2.0, storage_retry_s=0.3)
    ck = Checkpointer(tmp_path / "ckpt", ledger=led, config=config)
    try:
        ck.save(1, big)  # ~2 s to persist: in flight when its writer dies
        pid = ck.writer_pid
        assert pid is not None
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        assert ck.wait() is False  # recorded, not raised: training goes on
        assert time.monotonic() - t0 < 5.0  # at once (its socket closed), never an endless wait
        status = ck.storage
        assert status.failing and status.failures == 1, status
        assert "killed by SIGKILL" in str(status.last_error) and "step 1 is lost" in str(
            status.last_error
        )
        assert ck.save(2, big) is False  # inside the back-off: a snapshot in memory only
        time.sleep(0.35)
        assert ck.save(3, small)  # the next attempt, by another writer
        assert ck.wait() is True
        assert ck.writer_pid not in (None, pid)
        status = ck.storage
        assert not status.failing and status.total_failures == 1
        assert status.unprotected_s >= 0.3
    finally:
        ck.close()
    led.close()
    events = read_events(tmp_path)
    assert [e.get("step") for e in events if e.kind == ev.CKPT_FAIL] == [1]
    skips = [e for e in events if e.kind == ev.CKPT_SKIP]
    assert [e.get("step") for e in skips] == [2]
    assert skips[0].get("reason").startswith("storage failing for ")
    assert layout.committed_steps(tmp_path / "ckpt") == [3]


def test_stalled_storage_fails_the_save_kills_its_writer_and_the_older_checkpoint_survives(
    tmp_path: Path,
) -> None:
    led = Ledger(tmp_path, run="t", rank=0)
    config = CheckpointConfig(throttle_mbps=1.0, storage_retry_s=0.05)
    # 2 s: a 4 KB save and its commit on a busy machine fit (0.5 s did not, once); the 8 MB
    # save at 1 MB/s would take 8 s.
    ck = Checkpointer(tmp_path / "ckpt", ledger=led, config=config, persist_timeout_s=2.0)
    try:
        small = {"w": torch.arange(1000.0)}
        ck.save(1, small)
        assert ck.wait() is True
        stalled = ck.writer_pid
        ck.save(2, {"w": torch.randn(2 << 20)})  # the arena grows; 8 MB at 1 MB/s: stalls
        t0 = time.monotonic()
        assert ck.wait() is False
        assert time.monotonic() - t0 < 4.0
        assert "not durable after 2.0 s" in str(ck.storage.last_error)
        assert layout.committed_steps(tmp_path / "ckpt") == [1]
        assert layout.verify(layout.step_dir(tmp_path / "ckpt", 1)) is None
        time.sleep(0.1)
        small["w"].add_(1.0)
        ck.save(3, small)
        assert ck.wait() is True and ck.writer_pid != stalled
    finally:
        ck.close()
    led.close()
    assert [e.get("step") for e in read_events(tmp_path) if e.kind == ev.CKPT_FAIL] == [2]
    assert layout.committed_steps(tmp_path / "ckpt") == [3, 1]
    w = torch.zeros(1000)
    with Checkpointer(tmp_path / "ckpt", eager_writer=False) as ck:
        assert ck.restore({"w": w}) == 3
    assert torch.equal(w, torch.arange(1000.0) + 1.0)


def test_a_flipped_byte_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="t", rank=0)
    w = torch.zeros(4096)
    with Checkpointer(tmp_path / "ckpt", ledger=led, mode="sync", keep=3) as ck:
        for step in (1, 2, 3):
            w.fill_(step)
            ck.save(step, {"w": w, "rng": PerRank({"seed": torch.tensor([step])})})
    assert layout.committed_steps(tmp_path / "ckpt") == [3, 2, 1]
    data = layout.step_dir(tmp_path / "ckpt", 3) / layout.data_file(0)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(raw)
    seed = {"seed": torch.tensor([0])}
    with Checkpointer(tmp_path / "ckpt", ledger=led, eager_writer=False) as ck:
        assert ck.restore({"w": w, "rng": PerRank(seed)}) == 2
    led.close()
    assert torch.equal(w, torch.full((4096,), 2.0)) and int(seed["seed"]) == 2
    assert layout.committed_steps(tmp_path / "ckpt") == [2, 1]  # 3 moved out of sight
    assert [n.split(".")[1][:8] for n in os.listdir(tmp_path / "ckpt") if "3" in n] == ["rejected"]
    load = next(e for e in read_events(tmp_path) if e.kind == ev.CKPT_LOAD)
    assert load.get("rejected") == [3]
    fail = next(e for e in read_events(tmp_path) if e.kind == ev.CKPT_FAIL)
    assert fail.get("step") == 3 and "checksum mismatch" in fail.get("error")


def test_retention_and_nothing_to_restore(tmp_path: Path) -> None:
    """keep=2 leaves two checkpoints; a retired one's data file is written over in place by
    the save after its retirement (the same inode), cut to the new, smaller size, and the
    checkpoint restores exactly."""
    root = tmp_path / "ckpt"
    w = torch.ones(10)
    inodes = {}
    with Checkpointer(root, mode="sync", keep=2) as ck:
        assert ck.restore({"w": w}) is None and ck.latest() is None
        for step in range(4):
            w.fill_(step)
            ck.save(step, {"w": w, "note": {"text": "x" * (4000 - 1000 * step)}})
            inodes[step] = (layout.step_dir(root, step) / layout.data_file(0)).stat().st_ino
    assert layout.committed_steps(root) == [3, 2]
    names = [n for n in os.listdir(root) if not n.startswith(".owner")]
    assert sorted(names) == [layout.RECYCLE, "step-2", "step-3"]  # and the owner record, locks
    assert os.listdir(root / layout.RECYCLE) == [layout.data_file(0)]  # step 1's, for the next
    assert inodes[3] == inodes[0] and len(set(inodes.values())) == 3  # step 0's file, reused
    assert layout.verify(layout.step_dir(root, 3), checksums=True) is None  # size and CRC
    note: dict = {"text": ""}
    with Checkpointer(root, keep=2) as ck:
        assert ck.restore({"w": w, "note": note}) == 3
    assert torch.equal(w, torch.full((10,), 3.0)) and note["text"] == "x" * 1000


def test_bad_state_is_rejected_with_what_to_do(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ckpt") as ck:
        with pytest.raises(ValueError, match="expected an nn.Module"):
            ck.save(0, {"n": 3})
        with pytest.raises(ValueError, match="need exactly one module"):
            ck.save(0, {"o": _model(0)[1]})


def test_the_resolve_cache_gives_what_dcp_gives_and_relearns(tmp_path: Path) -> None:
    from unbroken.checkpoint.state.resolve import ResolveCache, resolve_for_save

    def items(state: dict[str, Any], cache: ResolveCache | None) -> list[tuple]:
        r = resolve_for_save(state, rank=0, world_size=1, overlap=True, cache=cache)
        return [
            (i.write_item.index.fqn, i.payload,
             None if i.tensor is None else (i.tensor.data_ptr(), i.tensor.shape), i.background)
            for i in r.items
        ]  # fmt: skip

    model, optim = _model(0)
    train_step(model, optim)
    state: dict[str, Any] = {"model": model, "optim": optim}
    cache = ResolveCache()
    for _ in range(3):  # learn, then the fast path twice
        assert items(state, cache) == items(state, None)
        train_step(model, optim)
    optim.param_groups[0]["lr"] = 0.01  # a changed value is serialized afresh
    assert items(state, cache) == items(state, None)
    state["optim"] = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, state["optim"])  # a new optimizer object: relearned
    assert items(state, cache) == items(state, None)
    assert items(state, cache) == items(state, None)


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.slow
def test_either_writer_start_saves_and_restores(tmp_path: Path, start: str) -> None:
    model, optim = _model(0)
    train_step(model, optim)
    with Checkpointer(tmp_path / "ckpt", config=CheckpointConfig(writer_start=start)) as ck:
        ck.save(3, {"model": model, "optim": optim})
        ck.wait()
    want = _snapshot(model, optim)
    model2, optim2 = _model(1)
    train_step(model2, optim2)
    with Checkpointer(tmp_path / "ckpt", eager_writer=False) as ck:
        assert ck.restore({"model": model2, "optim": optim2}) == 3
    assert _same(_snapshot(model2, optim2), want)


def _slow_storage_fault(root: Path) -> Path:
    """A slow-storage fault of one save on every rank, fired under ``root``; returns the file
    where rank 0's writer counts the saves it slowed."""
    root.mkdir()
    control = throttle.write_control(
        root, index=0, ranks=None, bytes_per_s=100e6, saves=1, seconds=None
    )
    return control.with_name("slow-0.rank-0.used")


def test_a_writer_without_hooks_reads_no_fault_control_file(tmp_path: Path) -> None:
    used = _slow_storage_fault(tmp_path / "ckpt")
    with Checkpointer(tmp_path / "ckpt") as ck:  # production: no hooks
        ck.save(0, {"w": torch.arange(1000.0)})
        ck.wait()
    assert not used.exists()
    assert layout.committed_steps(tmp_path / "ckpt") == [0]


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.slow
def test_injected_hooks_reach_the_writer(tmp_path: Path, start: str) -> None:
    """The hooks are pickled to the writer process (forked or spawned), which calls them."""
    used = _slow_storage_fault(tmp_path / "ckpt")
    w = torch.arange(1000.0)
    with Checkpointer(
        tmp_path / "ckpt",
        config=CheckpointConfig(writer_start=start),
        hooks=throttle.SlowStorage(),
    ) as ck:
        for step in (1, 2):
            ck.save(step, {"w": w})
            ck.wait()
    assert used.read_text() == "1"  # slowed exactly its one save, counted by the writer
    assert layout.committed_steps(tmp_path / "ckpt") == [2, 1]


def test_a_forked_writer_holds_none_of_the_trainers_connections(tmp_path: Path) -> None:
    """A fork inherits every descriptor; a writer keeping the trainer's peer or store sockets
    open would hide the trainer's close from its peers (no EOF). The child must drop them."""
    mine, peer = socket.socketpair()
    with Checkpointer(tmp_path / "ckpt", config=CheckpointConfig(writer_start="fork")) as ck:
        pid = ck.writer_pid
        assert pid is not None and pid != os.getpid()
        ck.save(0, {"w": torch.arange(10.0)})
        ck.wait()  # the writer serves: it is past dropping what it inherited
        mine.close()
        peer.settimeout(5.0)
        assert peer.recv(1) == b""  # EOF: no copy of `mine` lives on in the writer
        targets = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
        assert sum(t.startswith("socket:") for t in targets) == 1  # its own, to the trainer
    peer.close()
    assert layout.committed_steps(tmp_path / "ckpt") == [0]


def test_after_an_abort_the_next_checkpointer_restores_from_memory(tmp_path: Path) -> None:
    """An in-process restart: the failed iteration's Checkpointer is aborted, the next one on
    the same directory restores the newest fully staged step from memory, not disk."""
    led = Ledger(tmp_path, run="t", rank=0)
    model, optim = _model(0)
    cursor = Cursor()
    ck = Checkpointer(tmp_path / "ckpt", ledger=led, config=_throttled(0.05))  # never durable
    train_step(model, optim)
    cursor.position = 11
    ck.save(4, {"model": model, "optim": optim, "data": cursor})
    expected = _snapshot(model, optim)
    train_step(model, optim)  # the failed iteration went on, then failed
    cursor.position = 99
    ck.abort()
    assert layout.committed_steps(tmp_path / "ckpt") == []  # nothing on disk to restore

    model2, optim2 = _model(1)
    cursor2 = Cursor()
    with Checkpointer(tmp_path / "ckpt", ledger=led) as ck2:
        assert ck2.restore({"model": model2, "optim": optim2, "data": cursor2}) == 4
        assert _same(_snapshot(model2, optim2), expected) and cursor2.position == 11
        train_step(model2, optim2)
        ck2.save(5, {"model": model2, "optim": optim2, "data": cursor2})  # the arena, reused
    led.close()
    assert layout.committed_steps(tmp_path / "ckpt") == [5]
    loads = [e for e in read_events(tmp_path) if e.kind == ev.CKPT_LOAD]
    assert [(e.get("tier"), e.get("step")) for e in loads] == [("memory", 4)]


def test_a_snapshot_that_does_not_fit_falls_back_to_disk(tmp_path: Path) -> None:
    model, optim = _model(0)
    with Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(2, {"model": model, "optim": optim})
        ck.wait()
    expected = _snapshot(model, optim)
    ck = Checkpointer(tmp_path / "ckpt", config=_throttled(0.05))  # never durable: 5 s
    other = torch.nn.Linear(3, 3)
    pad = torch.zeros(1 << 16)
    ck.save(3, {"model": other, "optim": torch.optim.AdamW(other.parameters()), "pad": pad})
    ck.abort()
    model2, optim2 = _model(1)
    with Checkpointer(tmp_path / "ckpt") as ck2:
        assert ck2.restore({"model": model2, "optim": optim2}) == 2  # from disk
    assert _same(_snapshot(model2, optim2), expected)
