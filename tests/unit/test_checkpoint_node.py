"""A Checkpointer built under ``unbroken.run`` gets the node's memory keeper and peers unasked
(``unbroken.checkpoint.node``); a keyword, or a config that sets them, wins. Real keeper, one
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import CheckpointConfig, Checkpointer, node
from unbroken.checkpoint.config import merged
from unbroken.launcher.keeper import MemoryKeeper


def _state() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 4)}


def test_what_the_node_offers_fills_only_what_is_not_given() -> None:
    tiers = node.NodeTiers(memory_keeper="@k", peers=("a:1#t", "b:1#t"), peer_index=1)
    assert tiers.fields({}) == {"memory_keeper": "@k", "peers": tiers.peers, "peer_index": 1}
    assert tiers.fields({"memory_keeper": ""}) == {"peers": tiers.peers, "peer_index": 1}
    assert tiers.fields({"peers": ()}) == {"memory_keeper": "@k"}  # opting out of the peers
    assert node.NodeTiers().fields({}) == {}
    assert node.current() == node.NodeTiers()  # outside unbroken.run: nothing


def test_keywords_win_over_the_config_and_the_node_fills_what_neither_sets() -> None:
    offer = node.NodeTiers(memory_keeper="@k", peers=("a:1#t", "b:1#t"), peer_index=1).fields
    base = CheckpointConfig(every_steps=5, keep=3, throttle_mbps=2.0)
    given = {"every_steps": 10, "keep": None, "peers": ["x:1#t"], "peer_index": 0}
    cfg = merged(base, given, offer)
    assert (cfg.every_steps, cfg.keep, cfg.throttle_mbps) == (10, 3, 2.0)  # None: the config's
    assert (cfg.peers, cfg.peer_index, cfg.memory_keeper) == (("x:1#t",), 0, "@k")
    own = merged(CheckpointConfig(memory_keeper="@mine"), {}, offer)
    assert (own.memory_keeper, own.peers, own.peer_index) == ("@mine", ("a:1#t", "b:1#t"), 1)
    assert merged(None, {"memory_keeper": ""}, offer).memory_keeper == ""  # opting out
    assert merged(None, {}, node.NodeTiers().fields) == CheckpointConfig()
    with pytest.raises(ValueError, match="snapshot_every=2 needs memory_tier=True"):
        merged(CheckpointConfig(memory_tier=False), {"snapshot_every": 2}, offer)


def test_a_checkpointer_takes_keywords_over_its_config(tmp_path: Path) -> None:
    config = CheckpointConfig(keep=1, throttle_mbps=4.0, eager_writer=False)
    with Checkpointer(tmp_path / "ckpt", keep=3, mode="sync", config=config) as ckpt:
        assert (ckpt.config.keep, ckpt.config.mode, ckpt.config.throttle_mbps) == (3, "sync", 4.0)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        Checkpointer(tmp_path / "bad", keep=0, eager_writer=False)


@pytest.mark.timeout(60)
def test_a_checkpointer_in_a_run_hands_its_snapshots_to_the_node_keeper(tmp_path: Path) -> None:
    kept = MemoryKeeper()
    try:
        with node.provide(node.NodeTiers(memory_keeper=kept.addr)):
            with Checkpointer(tmp_path / "a", every_steps=1) as ckpt:
                assert ckpt.config.memory_keeper == kept.addr
                ckpt.save(0, _state())
            # A config that leaves them alone still gets them; a keyword wins over the node.
            with Checkpointer(tmp_path / "b", config=CheckpointConfig(every_steps=1)) as other:
                assert other.config.memory_keeper == kept.addr
                assert other.config.every_steps == 1
            with Checkpointer(tmp_path / "c", memory_keeper="") as third:
                assert third.config.memory_keeper == ""
                third.save(0, _state())
        assert node.current() == node.NodeTiers()
        held = kept.held()
        assert [k for k in held if k.startswith(str((tmp_path / "a").resolve()))], held
        assert not [k for k in held if "/c#" in k], held
    finally:
        kept.close()
