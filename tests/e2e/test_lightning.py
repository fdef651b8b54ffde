"""Lightning under unbroken-run: the adopted example (examples/lightning_ddp.py: the ``Unbroken``
callback, no other change to a Lightning script) through an exception, a hang and a SIGKILL on
2 ranks ends with the weights of the plain script's fault-free run, bit for bit, and its report
has the figures of any other job. The data loader is resumable and every batch a function of
its index, so Lightning's loop resumes exactly where the checkpoint was taken (mid-epoch, and
after a resume at an epoch's last batch: ``integrations.lightning`` corrects the epoch count
Lightning itself gets wrong there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from procs import run, unbroken_run_cmd, worker_env
from unbroken.ledger import goodput, read_run

pytest.importorskip("lightning", reason="the lightning extra: pip install 'unbroken[lightning]'")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 40  # 2 epochs of 20 batches
# An exception (in-process restart from the step-9 save), a hang at the first step of epoch 1
# (in-process again, from the step-19 save: the last batch of epoch 0), then a SIGKILL (the
# launcher restarts both workers, which resume mid-epoch 1 from the keeper's step-29 save).
PLAN = """faults:
  - {step: 15, rank: 0, kind: exception}
  - {step: 24, rank: 1, kind: hang}
  - {step: 32, rank: 1, kind: sigkill}
"""


def _run(run_dir: Path, script: str, *, faults: Path | None = None) -> str:
    env = worker_env()
    if faults is not None:
        env["UNBROKEN_FAULTS"] = str(faults)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = unbroken_run_cmd(
        run_dir,
        nproc=2,
        steps=None,
        target=[str(EXAMPLES / script)],
        launcher_args=["--max-restarts", "3"],
    )
    res = run(cmd, timeout_s=240, env=env, cwd=run_dir)
    assert res.returncode == 0, res.output[-4000:]
    hashes = res.hashes()
    assert len(hashes) == 1, res.output[-4000:]
    return hashes[0]


def test_a_lightning_trainer_recovers_bit_exact(tmp_path: Path) -> None:
    reference = _run(tmp_path / "plain", "plain_lightning_ddp.py")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run_dir = tmp_path / "adopted"
    assert _run(run_dir, "lightning_ddp.py", faults=plan) == reference

    rep = goodput.compute(read_run(run_dir).events)
    assert rep.steps_completed == STEPS
    faults = {f.kind: f for f in rep.faults}
    assert set(faults) == {"exception", "hang", "sigkill"}
    assert all(f.injected and f.recovery_s is not None for f in rep.faults)
    assert faults["exception"].layer == faults["hang"].layer == "inprocess"
    assert faults["hang"].detector == "watchdog"
    assert faults["sigkill"].layer == "launcher"
    assert (faults["exception"].restored_step, faults["hang"].restored_step) == (9, 19)
    assert faults["sigkill"].restored_step == 29
    assert {f.restore_tier for f in rep.faults} == {"memory"}
    assert rep.checkpoint_save_s > 0
    assert rep.custom_s.get("validation", 0) > 0  # Lightning's validation, a named phase
    observed = json.loads((run_dir / "launcher" / "heartbeats.json").read_text())
    assert observed["job_heartbeats"] and observed["steady_samples"] > 0
