"""A Checkpointer built under ``unbroken.run`` gets the node's memory keeper and peers unasked
(``unbroken.checkpoint.node``); an explicit config or keyword wins. Real keeper, one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import CheckpointConfig, Checkpointer, node
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


@pytest.mark.timeout(60)
def test_a_checkpointer_in_a_run_hands_its_snapshots_to_the_node_keeper(tmp_path: Path) -> None:
    kept = MemoryKeeper()
    try:
        with node.provide(node.NodeTiers(memory_keeper=kept.addr)):
            with Checkpointer(tmp_path / "a", every_steps=1) as ckpt:
                assert ckpt.config.memory_keeper == kept.addr
                ckpt.save(0, _state())
            # An explicit config is taken as it is; a keyword wins over the node.
            with Checkpointer(tmp_path / "b", config=CheckpointConfig(every_steps=1)) as other:
                assert other.config.memory_keeper == ""
                other.save(0, _state())
            with Checkpointer(tmp_path / "c", memory_keeper="") as third:
                assert third.config.memory_keeper == ""
        assert node.current() == node.NodeTiers()
        held = kept.held()
        assert [k for k in held if k.startswith(str((tmp_path / "a").resolve()))], held
        assert not [k for k in held if "/b#" in k or "/c#" in k], held
    finally:
        kept.close()
