"""A rank killed after a snapshot restores the step its survivor rescued, when they share it.

Two 2-rank launches with the node agent's memory keeper between them (here in the test
process, as ``unbroken-run`` runs it). The first trains 5 steps with a snapshot every 3 (step
2 in memory), notes steps 3 and 4, then rank 1 dies (``os._exit``: its note of step 4 is only
in its journal) and rank 0 rescues step 4 as a fault's abort does. The second restores:

- the same model and optimizer on both ranks (replicated, as data parallel keeps them): both
  resume from step 4, rank 0's model and optimizer bit for bit, and rank 1's generator as it
  was when it noted step 4 (its journal);
- each rank's own model (seeded by rank, as shards differ): the newest step both hold, 2.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from procs import VENV_BIN, run
from unbroken.launcher.keeper import MemoryKeeper

WORKER = textwrap.dedent(
    """
    import copy, hashlib, json, os, sys
    from datetime import timedelta
    from pathlib import Path
    import torch
    from unbroken.checkpoint import Checkpointer
    from unbroken.env import WorkerEnv
    from unbroken.ledger import Ledger, read_events
    from unbroken.workload import model as wmodel
    from unbroken.workload.dist import init_process_group

    root, out, keeper, life, mode = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:6]
    env = WorkerEnv.from_environ()
    init_process_group(env, run="catch", backend="gloo", timeout=timedelta(seconds=60))
    seed = env.rank if mode == "own" else 0
    model = wmodel.build_model(wmodel.get_config("tiny"), seed=seed)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = {"model": model, "optim": optim}
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(100 + env.rank)  # each rank's own generator

    def digest(m):  # the weights, bit for bit
        h = hashlib.sha256()
        for k, v in sorted(m.state_dict().items()):
            h.update(k.encode() + v.detach().numpy().tobytes())
        return h.hexdigest()

    mine = out.with_suffix(f".{env.rank}.json")
    if life == "1":
        ck = Checkpointer(root, snapshot_every=3, memory_keeper=keeper, run="catch")
        for step in range(5):
            wmodel.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optim.step()
            optim.zero_grad()
            torch.rand(1)  # the generator moves every step
            ck.maybe_save(step, state)
        mine.write_text(json.dumps({
            "next": torch.rand(1).item(),  # what the generator gives after step 4
            "weights": digest(model),
        }))
        if env.rank == 1:
            os._exit(0)  # killed: step 4 lives in its journal only
        ck.abort()  # the survivor's fault: it rescues step 4 into the arena the keeper holds
        os._exit(0)
    before = json.loads(mine.read_text())
    led = Ledger(out.parent / f"run{env.rank}", run="catch", rank=env.rank)
    with Checkpointer(root, ledger=led, memory_keeper=keeper, run="catch") as ck:
        restored = ck.restore(state)
        nxt = torch.rand(1).item()
    led.close()
    [load] = [e for e in read_events(out.parent / f"run{env.rank}") if e.kind == "ckpt_load"]
    mine.with_suffix(".after.json").write_text(json.dumps({
        "step": restored, "memory": load.get("memory"), "why": load.get("why"),
        "generator": nxt == before["next"],
        "weights": digest(model) == before["weights"],
    }))
    """
)


@pytest.mark.parametrize("mode", ["same", "own"])
def test_a_killed_rank_takes_the_step_its_survivor_rescued_when_the_state_is_replicated(
    tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    keeper = MemoryKeeper()
    try:
        for life in ("1", "2"):
            cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                   "--monitor-interval", "0.1", str(script), str(tmp_path / "ckpt"),
                   str(tmp_path / "out"), keeper.addr, life, mode]  # fmt: skip
            res = run(cmd, timeout_s=180)
            assert res.returncode == 0, res.output[-4000:]
    finally:
        keeper.close()
    got = [json.loads((tmp_path / f"out.{r}.after.json").read_text()) for r in (0, 1)]
    assert [g["memory"] for g in got] == [[[4, 2], [2]]] * 2, got
    if mode == "same":
        assert [g["step"] for g in got] == [4, 4], got
        assert "journal" in got[1]["why"], got
        # Rank 1's weights are rank 0's at step 4 (equal to its own there), its generator its own.
        assert all(g["weights"] and g["generator"] for g in got), got
    else:
        assert [g["step"] for g in got] == [2, 2], got
        assert not any(g["weights"] for g in got), got  # step 2's weights, not step 4's
