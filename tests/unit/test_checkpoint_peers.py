"""The peer memory tier on real sockets: a Checkpointer of "node 0" replicates each sealed
snapshot to node 1's service, a fresh process's Checkpointer with nothing in local memory
fetches the newest one back (bit for bit), a damaged replica falls back to an older step or to
disk (never an error), a torn or unauthenticated put is refused, and a node's keeper arenas
are served to the others."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from toy import mlp, train_step
from unbroken.checkpoint import CheckpointConfig, Checkpointer, layout
from unbroken.checkpoint.staging import memory, ring_format
from unbroken.checkpoint.staging.arena import Arena, Slot, copy_into
from unbroken.checkpoint.tiers import keeper, peers
from unbroken.launcher.keeper import MemoryKeeper
from unbroken.ledger import Ledger, read_events

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def nodes() -> Iterator[list[peers.PeerService]]:
    services = [peers.PeerService(host="127.0.0.1", bind="127.0.0.1") for _ in range(2)]
    yield services
    for s in services:
        s.close()


def _addrs(services: list[peers.PeerService]) -> tuple[str, ...]:
    return tuple(str(s.peer) for s in services)


def _train_on_node0(
    root: Path, services: list[peers.PeerService], steps: int, led: Ledger | None = None
) -> dict[str, torch.Tensor]:
    """Steps 0..steps-1 snapshotted every step (durable every 3); returns the final weights.
    The Checkpointer is closed after its replicator sent the last snapshot."""
    model, optim = mlp(0)
    state = {"model": model, "optim": optim}
    ck = Checkpointer(
        root,
        ledger=led,
        every_steps=3,
        snapshot_every=1,
        memory_slots=3,  # a ring: snapshots while a save persists
        peers=_addrs(services),
        peer_index=0,
    )
    for step in range(steps):
        train_step(model, optim)
        ck.maybe_save(step, state)
        ck.wait_staged()
        assert ck._replica is not None and ck._replica.idle(10.0)
    ck.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_next_node_holds_the_two_newest_and_a_fresh_process_restores_the_newest(
    tmp_path: Path, nodes: list[peers.PeerService]
) -> None:
    want = _train_on_node0(tmp_path / "ckpt", nodes, steps=5)
    key = f"{(tmp_path / 'ckpt').resolve()}#rank0"
    assert nodes[1].held() == {key: [4, 3]}  # node 0 -> node 1, never to itself
    assert nodes[0].held() == {}
    led = Ledger(tmp_path, run="t", rank=0)
    model2, optim2 = mlp(1)
    with Checkpointer(tmp_path / "ckpt", ledger=led, peers=_addrs(nodes), peer_index=1) as ck:
        assert ck.restore({"model": model2, "optim": optim2}) == 4  # disk has only step 2
    led.close()
    assert all(torch.equal(v, want[k]) for k, v in model2.state_dict().items())
    [load] = [e for e in read_events(tmp_path) if e.kind == "ckpt_load"]
    assert (load.get("tier"), load.get("source"), load.get("step")) == ("peer", "peer", 4)
    assert "checksums verified" in str(load.get("why"))


_SERVICE_ALONE = """
import json, sys
from unbroken.checkpoint.tiers.peers import PeerService
service = PeerService(host="127.0.0.1", bind="127.0.0.1")
print(service.peer, flush=True)
sys.stdin.readline()
print(json.dumps({"held": service.held(), "torch": "torch" in sys.modules}), flush=True)
service.close()
"""


@pytest.mark.slow
def test_a_service_without_torch_takes_replicas_and_serves_them(
    tmp_path: Path, nodes: list[peers.PeerService]
) -> None:
    """The node agent runs the service: it keeps and serves replicas as bytes and never
    imports torch (a second or two of CPU at an agent's start, on the cores its workers need)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVICE_ALONE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        alone = types.SimpleNamespace(peer=child.stdout.readline().strip())
        want = _train_on_node0(tmp_path / "ckpt", [nodes[0], alone], steps=5)
        addrs = (str(nodes[0].peer), alone.peer)
        model2, optim2 = mlp(1)
        with Checkpointer(tmp_path / "ckpt", peers=addrs, peer_index=1) as ck:
            assert ck.restore({"model": model2, "optim": optim2}) == 4  # from the replica
        assert all(torch.equal(v, want[k]) for k, v in model2.state_dict().items())
        child.stdin.write("done\n")
        child.stdin.flush()
        seen = json.loads(child.stdout.readline())
    finally:
        child.kill()  # done with it (or a failure above left it waiting for "done")
        child.wait()
    key = f"{(tmp_path / 'ckpt').resolve()}#rank0"
    assert seen == {"held": {key: [4, 3]}, "torch": False}


def _damage(service: peers.PeerService, key: str, step: int) -> None:
    arena = service._replicas[key].arena
    snap = next(s for s in memory.read(arena)[1] if s.step == step)
    slot = snap.tensors[0][1]
    arena.write(slot.offset + 3, bytes([arena.read(slot.offset + 3, 1)[0] ^ 0x40]))


def test_a_damaged_replica_falls_back_to_the_older_one_then_to_disk(
    tmp_path: Path, nodes: list[peers.PeerService]
) -> None:
    root = tmp_path / "ckpt"
    _train_on_node0(root, nodes, steps=5)
    key = f"{root.resolve()}#rank0"
    _damage(nodes[1], key, 4)
    model2, optim2 = mlp(1)
    with Checkpointer(root, peers=_addrs(nodes), peer_index=1) as ck:
        assert ck.restore({"model": model2, "optim": optim2}) == 3
    _damage(nodes[1], key, 3)
    model3, optim3 = mlp(1)
    with Checkpointer(root, peers=_addrs(nodes), peer_index=1) as ck:
        assert ck.restore({"model": model3, "optim": optim3}) == 2  # the committed one
    assert layout.committed_steps(root) == [2]


def _sealed_region(ring: ring_format.Ring, *, step: int) -> bytes:
    """The bytes of region 0 of a ring holding one sealed snapshot of ``step``."""
    arena = Arena()
    arena.ensure(ring.total)
    ring_format.write_ring(arena, ring)
    slot = Slot(ring.data_base(0), 1024, torch.float32, (256,))
    copy_into(arena, [(torch.arange(256.0) + step, slot)])
    snap = memory.Snapshot(
        step=step, rank=0, world_size=1, arena=arena, region=0,
        tensors=[(MetadataIndex("w"), slot)], payloads=[], digests=[], seq=1,
    )  # fmt: skip
    memory.seal(snap, ring)
    data = arena.read(ring.base(0), ring.stride)
    arena.close()
    return data


def _put(service: peers.PeerService, token: str, verdict: bytes) -> dict[str, object]:
    ring = ring_format.Ring(2, 4096, 65536)
    with socket.create_connection(("127.0.0.1", service.peer.port), timeout=5) as sock:
        msg = {"op": "put", "key": "k", "token": token, "stride": ring.stride}
        msg |= {"data_bytes": ring.data_bytes, "meta_cap": ring.meta_cap}
        data = json.dumps(msg).encode()
        sock.sendall(len(data).to_bytes(4, "big") + data)
        if token == service.peer.token:
            sock.sendall(_sealed_region(ring, step=7))
            sock.sendall(verdict)
        n = int.from_bytes(sock.recv(4), "big")
        return dict(json.loads(sock.recv(n)))


def test_a_torn_put_and_a_wrong_token_leave_nothing(nodes: list[peers.PeerService]) -> None:
    assert _put(nodes[0], nodes[0].peer.token, b"\x00") == {"ok": True, "committed": False}
    assert nodes[0].held() == {"k": []}
    assert _put(nodes[0], "not-the-token", b"") == {"ok": False, "error": "bad token"}
    wrong = peers.Peer("127.0.0.1", nodes[0].peer.port, "not-the-token")
    assert peers.fetch([wrong], "k") == (None, None)


def test_old_replicas_are_dropped_two_rounds_on(nodes: list[peers.PeerService]) -> None:
    nodes[0].begin_round(3)
    _put(nodes[0], nodes[0].peer.token, b"\x01")
    assert nodes[0].held() == {"k": [7]}
    nodes[0].begin_round(4)  # its rank may have moved: kept for the round that fetches it
    assert nodes[0].held() == {"k": [7]}
    nodes[0].begin_round(5)
    assert nodes[0].held() == {}


def test_a_nodes_keeper_arenas_are_served_to_the_others(tmp_path: Path) -> None:
    """Ranks moved to other nodes (a lost node, a new round): rank 0's arena, kept by node A's
    keeper, reaches the process of rank 0 on node B."""
    kept = MemoryKeeper()
    service = peers.PeerService(host="127.0.0.1", bind="127.0.0.1", local=kept.dup)
    other = peers.PeerService(host="127.0.0.1", bind="127.0.0.1")
    root = tmp_path / "ckpt"
    try:
        model, optim = mlp(0)
        state = {"model": model, "optim": optim}
        ck = Checkpointer(root, snapshot_every=1, memory_keeper=kept.addr)
        for step in range(3):
            train_step(model, optim)
            ck.maybe_save(step, state)
        ck.wait_staged()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        ck.abort()
        memory.take(root.resolve())  # a new process: nothing in this one's table
        arena, where = peers.fetch([service.peer], f"{root.resolve()}#rank0")
        assert arena is not None and where == f"keeper of 127.0.0.1:{service.peer.port}"
        assert [s.step for s in memory.read(arena)[1]] == [2]  # one snapshot (memory_slots 1)
        # Only the part up to the last snapshot came, and only it takes memory here.
        assert os.fstat(arena.fd).st_blocks * 512 < 0.75 * arena.size
        arena.close()
        model2, optim2 = mlp(1)
        with Checkpointer(root, peers=(str(service.peer), str(other.peer)), peer_index=1) as ck2:
            assert ck2.restore({"model": model2, "optim": optim2}) == 2
        assert all(torch.equal(v, want[k]) for k, v in model2.state_dict().items())
    finally:
        service.close()
        other.close()
        kept.close()


def test_peer_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="peer_index must be this node's position"):
        CheckpointConfig(peers=("a:1#t", "b:2#t"), peer_index=2)
    with pytest.raises(ValueError, match="host:port#token"):
        CheckpointConfig(peers=("a:1",), peer_index=0)
    assert peers.Peer.parse("[::1]:80#x") == peers.Peer("::1", 80, "x")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_the_keeper_refuses_another_users_process() -> None:
    """Its socket is abstract, so any process in the network namespace can connect: one of
    another user can neither take an arena nor plant one."""
    kept = MemoryKeeper()
    try:
        fd = os.memfd_create("t")
        os.ftruncate(fd, 4096)
        assert keeper.put(kept.addr, "k", fd)
        os.close(fd)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the other user's process: nothing but a connection to the socket
            try:
                os.setgid(65534)
                os.setuid(65534)
                planted = os.memfd_create("x")
                got = (keeper.get(kept.addr, "k"), keeper.put(kept.addr, "k", planted))
                os.write(w, repr(got).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            answer = f.read()
        os.waitpid(pid, 0)
        assert answer == "(None, False)"
        assert kept.refused == 2 and kept.held() == {"k": 4096}
    finally:
        kept.close()


class _Planted:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (os.abort, ())  # what a planted replica could run, were it loaded


def test_a_replica_whose_values_are_not_plain_is_refused_before_any_is_loaded() -> None:
    ring = ring_format.Ring(2, 4096, 65536)
    arena = Arena()
    arena.ensure(ring.total)
    ring_format.write_ring(arena, ring)
    good, bad = io.BytesIO(), io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.99)}, good)
    torch.save(_Planted(), bad)
    for region, payload in enumerate((good.getvalue(), bad.getvalue())):
        snap = memory.Snapshot(
            step=region, rank=0, world_size=1, arena=arena, region=region, tensors=[],
            payloads=[(MetadataIndex("v"), payload)], digests=[], seq=region + 1,
        )  # fmt: skip
        memory.seal(snap, ring)
    newest, older = memory.read(arena)[1]
    assert memory.verify(older, untrusted=True) is None
    assert memory.verify(newest) is None  # this process's own: trusted
    why = memory.verify(newest, untrusted=True)
    assert why is not None and why.startswith("step 1: 'v' is not a plain value")
    arena.close()
