"""Hugging Face Accelerate under unbroken-run: the adopted example (examples/accelerate_ddp.py:
its Checkpointer takes ``state_of(accelerator)`` in place of ``save_state``/``load_state``)
through an exception, a hang and a SIGKILL on 2 ranks ends with the weights of the plain
script's fault-free run, bit for bit (its LR scheduler halves the rate at step 15: the
scheduler's state is restored too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from procs import run, unbroken_run_cmd, worker_env
from unbroken.ledger import goodput, read_run

pytest.importorskip("accelerate", reason="the accelerate extra: pip install 'unbroken[accelerate]'")

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
    res = run(cmd, timeout_s=240, env=env, cwd=run_dir)
    assert res.returncode == 0, res.output[-4000:]
    hashes = res.hashes()
    assert len(hashes) == 1, res.output[-4000:]
    return hashes[0]


def test_an_accelerate_script_recovers_bit_exact(tmp_path: Path) -> None:
    reference = _run(tmp_path / "plain", "plain_accelerate.py")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run_dir = tmp_path / "adopted"
    assert _run(run_dir, "accelerate_ddp.py", faults=plan) == reference

    rep = goodput.compute(read_run(run_dir).events)
    assert rep.steps_completed == 40
    faults = {f.kind: f for f in rep.faults}
    assert set(faults) == {"exception", "hang", "sigkill"}
    assert all(f.injected and f.recovery_s is not None for f in rep.faults)
    assert faults["exception"].layer == faults["hang"].layer == "inprocess"
    assert faults["sigkill"].layer == "launcher"
    assert [faults[k].restored_step for k in ("exception", "hang", "sigkill")] == [9, 19, 29]
    assert {f.restore_tier for f in rep.faults} == {"memory"}


def test_state_of_refuses_an_accelerator_with_nothing_prepared() -> None:
    # In a process of its own: an Accelerator sets up a process-wide singleton.
    code = (
        "from accelerate import Accelerator\n"
        "from unbroken.integrations.accelerate import state_of\n"
        "try:\n    state_of(Accelerator(cpu=True))\n"
        "except ValueError as e:\n    print(e)\n"
    )
    res = run([sys.executable, "-c", code], timeout_s=60)
    assert res.returncode == 0 and "prepared 0 models" in res.output, res.output
