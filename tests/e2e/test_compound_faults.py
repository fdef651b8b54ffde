"""Several faults at one instant, and faults inside another's window: both ranks raising at
the same step, a SIGKILL on one rank while the other raises, and a hang while slow storage
still throttles the saves. The job finishes with a fault-free run's weights."""

from __future__ import annotations

from pathlib import Path

from procs import final, run, unbroken_run_cmd, worker_env
from unbroken.ledger import goodput, read_run

PLAN = """faults:
  - {step: 6, rank: 0, kind: exception}
  - {step: 6, rank: 1, kind: exception}
  - {step: 14, rank: 0, kind: sigkill}
  - {step: 14, rank: 1, kind: exception}
  - {step: 20, rank: 0, kind: slow-storage, mbps: 1, seconds: 6, ranks: all}
  - {step: 23, rank: 1, kind: hang}
"""
ARGS = ["--ckpt-every", "5", "--snapshot-every", "1", "--soft-timeout-s", "1"]


def _run(run_dir: Path, plan: Path | None) -> str:
    extra = [*ARGS, *(["--faults", str(plan)] if plan else [])]
    cmd = unbroken_run_cmd(
        run_dir,
        nproc=2,
        steps=30,
        extra=extra,
        launcher_args=["--max-restarts", "3", "--ft-steady-timeout-s", "4"],
    )
    res = run(cmd, timeout_s=300, env=worker_env(UNBROKEN_MAX_RANK_FAULTS="10"))
    assert res.returncode == 0, res.output[-4000:]
    return final(run_dir)["final_state_sha256"]


def test_compound_faults_are_recovered_bit_exact(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    clean = _run(tmp_path / "clean", None)
    assert _run(tmp_path / "faulted", plan) == clean
    report = goodput.compute(read_run(tmp_path / "faulted").events)
    injected = [f for f in report.faults if f.injected]
    assert sorted((f.step, f.rank, f.kind) for f in injected) == [
        (6, 0, "exception"),
        (6, 1, "exception"),
        (14, 0, "sigkill"),
        (14, 1, "exception"),
        (20, 0, "slow-storage"),
        (23, 1, "hang"),
    ]
    assert all(f.recovery_s is not None for f in injected if f.disruptive)
    assert report.steps_completed == 30
