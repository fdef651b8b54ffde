"""Save on two FSDP2 ranks; restore on one (plain model, no process group) and on three FSDP2
ranks. The gathered model and optimizer state after restore equals the one saved, bit for bit,
and the data sampler resumes at the saved position."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from procs import VENV_BIN, run

WORKER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    from pathlib import Path
    import torch
    from unbroken.checkpoint import Checkpointer, layout
    from unbroken.env import WorkerEnv
    from unbroken.workload import data as wdata, model as wmodel
    from unbroken.workload.dist import init_process_group
    from unbroken.workload.parallel import wrap_model
    from unbroken.workload.train import final_state_hash

    mode, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    env = WorkerEnv.from_environ()
    parallel = "fsdp" if env.launched else "none"
    if env.launched:
        init_process_group(env, run="reshard", backend="gloo", timeout=timedelta(seconds=60))
    cfg = wmodel.get_config("tiny")
    model = wrap_model(wmodel.build_model(cfg, seed=0 if mode == "save" else 7),
                       parallel=parallel, device="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    dataset = wdata.SyntheticDataset(wdata.MarkovLanguage(cfg.vocab_size, seed=0),
                                     seq_len=16, num_samples=4096)
    sampler = wdata.ResumableSampler(4096, global_batch=12, rank=env.rank,
                                     world_size=env.world_size, seed=0)
    state = {"model": model, "optim": optim, "data": sampler}
    with Checkpointer(root, eager_writer=mode == "save") as ck:
        if mode == "save":
            for step in range(3):
                inputs, targets = dataset.get_batch(sampler.next_indices())
                wmodel.loss_fn(model(inputs), targets).backward()
                optim.step()
                optim.zero_grad()
            ck.save(2, state)
            step = 2
        else:
            step = ck.restore(state)
    digest = final_state_hash(model, optim)  # collective: after close, on every rank
    if env.rank == 0:
        files = sorted(p.name for p in layout.step_dir(root, 2).iterdir())
        out.write_text(json.dumps({"step": step, "hash": digest, "position": sampler.position,
                                   "world": env.world_size, "files": files}))
    """
)


def _launch(tmp_path: Path, nproc: int | None, mode: str, name: str) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"{name}.json"
    args = [str(script), mode, str(tmp_path / "ckpt"), str(out)]
    if nproc is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
               "--monitor-interval", "0.1", *args]  # fmt: skip
    res = run(cmd, timeout_s=180)
    assert res.returncode == 0, res.output[-4000:]
    return json.loads(out.read_text())


def test_save_on_two_ranks_restores_on_one_and_three(tmp_path: Path) -> None:
    saved = _launch(tmp_path, 2, "save", "saved")
    assert saved["files"] == [
        ".metadata", "COMMITTED", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip
    assert saved["position"] == 36
    for nproc in (None, 3):
        got = _launch(tmp_path, nproc, "restore", f"restored-{nproc}")
        assert got["world"] == (nproc or 1)
        assert got["step"] == 2
        assert got["hash"] == saved["hash"], f"state differs after restore on {nproc} rank(s)"
        assert got["position"] == saved["position"]
