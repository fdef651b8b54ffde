"""Ranks that never disagree on a step they all hold.

- A ring of snapshots (``memory_slots`` 3): two ranks whose newest snapshots differ (rank 0
  sealed step 2, rank 1's copy of step 2 never finished: it holds steps 0 and 1) restore the
  newest step both hold, step 1, from memory and bit for bit; the ledger says which steps each
  rank held. One slot without the ranks' agreement would have left them nothing in common.
- One snapshot per rank (``memory_slots`` 1, the default): a rank replaces it only once every
  rank has agreed to. Rank 1 "dies" before staging step 2 (its process ends); rank 0's
  agreement fails with it, and rank 0 still holds step 1, sealed and intact."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from procs import VENV_BIN, run

PRELUDE = """
import copy, json, os, sys
from datetime import timedelta
from pathlib import Path
import torch
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.staging import memory
from unbroken.env import WorkerEnv
from unbroken.workload import model as wmodel
from unbroken.workload.dist import init_process_group
from unbroken.ledger import Ledger, read_events

root, out = Path(sys.argv[1]), Path(sys.argv[2])
env = WorkerEnv.from_environ()
init_process_group(env, run="common", backend="gloo", timeout=timedelta(seconds=60))
model = wmodel.build_model(wmodel.get_config("tiny"), seed=0)
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
state = {"model": model, "optim": optim}
tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
"""

WORKER = PRELUDE + textwrap.dedent(
    """
    ck = Checkpointer(root, snapshot_every=1, memory_slots=3, eager_writer=False, run="common")
    after = {}
    for step in range(3):
        wmodel.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optim.step()
        optim.zero_grad()
        after[step] = copy.deepcopy((model.state_dict(), optim.state_dict()))
        if step < 2 or env.rank == 0:  # rank 1 "dies" before step 2 is staged
            ck.maybe_save(step, state)
    ck.abort()
    led = Ledger(out.parent / f"run{env.rank}", run="common", rank=env.rank)
    with Checkpointer(root, ledger=led, eager_writer=False) as ck2:
        restored = ck2.restore(state)
    led.close()
    want_model, want_optim = after[1]
    exact = all(torch.equal(v, want_model[k]) for k, v in model.state_dict().items())
    got = optim.state_dict()["state"]
    exact = exact and all(torch.equal(got[p][k], want_optim["state"][p][k])
                          for p in got for k in got[p])
    [load] = [e for e in read_events(out.parent / f"run{env.rank}") if e.kind == "ckpt_load"]
    out.with_suffix(f".{env.rank}.json").write_text(json.dumps(
        {"step": restored, "exact": exact, "tier": load.get("tier"),
         "memory": load.get("memory"), "source": load.get("source")}))
    """
)


def test_ranks_that_staged_different_steps_restore_the_newest_common_one(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", str(script), str(tmp_path / "ckpt"),
           str(tmp_path / "out")]  # fmt: skip
    res = run(cmd, timeout_s=180)
    assert res.returncode == 0, res.output[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert got == {
            "step": 1,
            "exact": True,
            "tier": "memory",
            "memory": [[2, 1, 0], [1, 0]],
            "source": "process",
        }, got


LEAN = PRELUDE + textwrap.dedent(
    """
    ck = Checkpointer(root, snapshot_every=1, eager_writer=False, run="common")
    failed = None
    for step in range(3):
        wmodel.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optim.step()
        optim.zero_grad()
        if step == 2 and env.rank == 1:  # dies before staging step 2
            os._exit(0)
        try:
            ck.maybe_save(step, state)
        except Exception as e:  # rank 0: the agreement on step 2, without rank 1
            failed = type(e).__name__
    ck.abort()  # keeps the arena for this process (the memory tier)
    arena = memory.take(root.resolve())
    held = [s.step for s in memory.read(arena)[1]]
    sealed = memory.verify(memory.read(arena)[1][0]) if held else None
    out.with_suffix(f".{env.rank}.json").write_text(
        json.dumps({"failed": failed, "held": held, "intact": sealed is None}))
    os._exit(0)
    """
)


def test_a_rank_that_never_reaches_a_snapshot_keeps_the_others_from_replacing_theirs(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(LEAN)
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", str(script), str(tmp_path / "ckpt"),
           str(tmp_path / "out")]  # fmt: skip
    res = run(cmd, timeout_s=180)
    assert res.returncode == 0, res.output[-4000:]
    got = json.loads((tmp_path / "out.0.json").read_text())
    assert got["failed"] is not None, got  # the all-reduce without rank 1
    assert got["held"] == [1] and got["intact"], got
