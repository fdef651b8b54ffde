"""A configuration from outside the script: the environment's overrides (``unbroken.env``), as
a Checkpointer and ``unbroken.run`` apply them; the generators and the final digest a
Checkpointer adds to the state it is given."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sinks import Sink
from unbroken.checkpoint import CheckpointConfig
from unbroken.checkpoint.config import overridden
from unbroken.checkpoint.state.digest import local_digest
from unbroken.checkpoint.state.extras import RNG_KEY, StateExtras
from unbroken.env import Overrides
from unbroken.job import _restart_config
from unbroken.restart import RestartConfig


def test_every_override_is_read_and_named() -> None:
    o = Overrides.from_environ(
        {
            "UNBROKEN_CKPT_MODE": "sync",
            "UNBROKEN_CKPT_EVERY": "7",
            "UNBROKEN_SNAPSHOT_EVERY": "2",
            "UNBROKEN_INPROCESS": "0",
            "UNBROKEN_SOFT_TIMEOUT_S": "1.5",
            "UNBROKEN_PHASE_TIMEOUTS": "validation=30, data=2",
            "UNBROKEN_MAX_RANK_FAULTS": "9",
            "UNBROKEN_FINAL_DIGEST": "1",
        }
    )
    assert o.given() == {
        "ckpt_mode": "sync",
        "ckpt_every": 7,
        "snapshot_every": 2,
        "inprocess": False,
        "soft_timeout_s": 1.5,
        "phase_timeouts_s": {"data": 2.0, "validation": 30.0},
        "max_rank_faults": 9,
        "final_digest": True,
    }
    assert Overrides.from_environ({}).given() == {}


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("UNBROKEN_CKPT_MODE", "fast", 'must be "async" or "sync"'),
        ("UNBROKEN_CKPT_EVERY", "-1", "integer >= 0"),
        ("UNBROKEN_MAX_RANK_FAULTS", "0", "integer >= 1"),
        ("UNBROKEN_INPROCESS", "maybe", "must be 1 or 0"),
        ("UNBROKEN_SOFT_TIMEOUT_S", "inf", "seconds > 0"),
        ("UNBROKEN_PHASE_TIMEOUTS", "data", "name=seconds"),
        ("UNBROKEN_PHASE_TIMEOUTS", "data=0", "seconds > 0"),
    ],
)
def test_a_malformed_override_names_itself(name: str, value: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"{name}={value!r}: .*{says}"):
        Overrides.from_environ({name: value})


def test_overrides_win_over_the_scripts_checkpoint_settings() -> None:
    given = CheckpointConfig(every_steps=10, mode="async", snapshot_every=0, memory_tier=True)
    o = Overrides(ckpt_mode="sync", ckpt_every=3, snapshot_every=2, final_digest=True)
    c = overridden(given, o)
    assert (c.mode, c.every_steps, c.snapshot_every, c.final_digest) == ("sync", 3, 2, True)
    off = overridden(CheckpointConfig(snapshot_every=5), Overrides(memory_tier=False))
    assert (off.memory_tier, off.snapshot_every) == (False, 0)
    assert overridden(given, Overrides()) is given
    with pytest.raises(ValueError, match="UNBROKEN_MEMORY_TIER=0"):
        overridden(given, Overrides(memory_tier=False, snapshot_every=1))


def test_overrides_win_over_the_scripts_restart_config() -> None:
    script = RestartConfig(soft_timeout_s=5.0, phase_timeouts_s={"validation": 60.0})
    o = Overrides(inprocess=False, soft_timeout_s=0.5, phase_timeouts_s=(("data", 2.0),))
    c = _restart_config(script, o)
    assert (c.enabled, c.soft_timeout_s) == (False, 0.5)
    assert dict(c.phase_timeouts_s) == {"validation": 60.0, "data": 2.0}
    hard = _restart_config(RestartConfig(), Overrides(hard_timeout_s=200.0))
    assert hard.barrier_timeout_s >= 260.0  # peers wait out a rank the hard timeout kills
    with pytest.raises(ValueError, match="do not fit the script's RestartConfig"):
        _restart_config(RestartConfig(hard_timeout_s=2.0), Overrides(soft_timeout_s=5.0))


def test_the_generators_ride_with_the_state_and_come_back() -> None:
    extras = StateExtras(CheckpointConfig())
    state = {"w": torch.zeros(3)}
    full = extras.full(state)
    assert set(full) == {"w", RNG_KEY} and extras.full(state) is full  # the same, again
    saved = full[RNG_KEY].obj.state_dict()
    drawn = (torch.rand(4), random.random(), np.random.rand())
    full[RNG_KEY].obj.load_state_dict(saved)
    again = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]
    noted = {"w": state["w"], RNG_KEY: "as noted"}  # a rescued note keeps its own
    assert extras.full(noted) is noted
    assert StateExtras(CheckpointConfig(rng=False)).full(state) is state


def test_the_final_digest_covers_the_scripts_state_only() -> None:
    extras = StateExtras(CheckpointConfig(final_digest=True))
    model = torch.nn.Linear(2, 2)
    extras.full({"model": model})
    before = local_digest({"model": model})
    sink = Sink()
    extras.record_digest(sink, step=4)
    torch.rand(3)  # the generators move: the digest does not
    extras.record_digest(sink, step=4)
    with torch.no_grad():
        model.weight[0, 0] += 1
    extras.record_digest(sink, step=4)
    digests = [d["digest"] for kind, d in sink.events if kind == "final_state"]
    assert before == digests[0] == digests[1] != digests[2]
