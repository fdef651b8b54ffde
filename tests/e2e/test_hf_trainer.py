"""The Hugging Face Trainer under unbroken-run: the adopted example (examples/hf_trainer.py:
``unbroken.integrations.transformers.Trainer`` in place of ``transformers.Trainer``) through an
exception, a hang and a SIGKILL on 2 ranks ends with the weights of the plain script's
fault-free run, bit for bit: each restore comes from memory, and the Trainer's own resume path
skips the batches the resumed epoch had seen (its sampler shuffles with its seed) and restores
its linear LR schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from procs import run, unbroken_run_cmd, worker_env
from unbroken.ledger import goodput, read_run

pytest.importorskip(
    "transformers", reason="the transformers extra: pip install 'unbroken[transformers]'"
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
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
    res = run(cmd, timeout_s=300, env=env, cwd=run_dir)
    assert res.returncode == 0, res.output[-4000:]
    hashes = res.hashes()
    assert len(hashes) == 1, res.output[-4000:]
    return hashes[0]


def test_a_hugging_face_trainer_recovers_bit_exact_from_memory(tmp_path: Path) -> None:
    reference = _run(tmp_path / "plain", "plain_hf_trainer.py")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run_dir = tmp_path / "adopted"
    assert _run(run_dir, "hf_trainer.py", faults=plan) == reference

    rep = goodput.compute(read_run(run_dir).events)
    assert rep.steps_completed == 40
    faults = {f.kind: f for f in rep.faults}
    assert set(faults) == {"exception", "hang", "sigkill"}
    assert all(f.injected and f.recovery_s is not None for f in rep.faults)
    assert faults["exception"].layer == faults["hang"].layer == "inprocess"
    assert faults["sigkill"].layer == "launcher"
    assert [faults[k].restored_step for k in ("exception", "hang", "sigkill")] == [9, 19, 29]
    assert {f.restore_tier for f in rep.faults} == {"memory"}
    # The Trainer's own state came back with the step, its log entry included (the save waits
    # for the Trainer to log the step): each logged step once, none lost to a resume.
    state = json.loads(
        next((run_dir / "ckpt" / "hf-resume").glob("rank0/trainer_state.json")).read_text()
    )
    assert state["global_step"] == 30
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [10, 20, 30]
