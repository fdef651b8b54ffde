"""A fault in every phase of examples/fsdp.py under unbroken-run: init, data, save, persist,
restore, validation, recovery (a second fault while one is recovered) and shutdown. Every one
is recovered, the final weights equal a fault-free run's, and the report gives each fault's
phase and what it cost."""

from __future__ import annotations

from pathlib import Path

from procs import run, unbroken_run_cmd, worker_env
from unbroken.ledger import goodput, read_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp.py"
# Phases fire on entry. The occurrences count entries on that rank over the run: restore #1 is
# the first start's, #2 the in-process restart's after the init fault.
PLAN = """faults:
  - {phase: init, rank: 1, kind: exception}
  - {phase: restore, occurrence: 3, rank: 0, kind: exception}
  - {phase: data, step: 5, rank: 0, kind: exception}
  - {phase: recovery, occurrence: 3, rank: 1, kind: exception}
  - {phase: save, step: 8, rank: 1, kind: sigkill}
  - {phase: persist, step: 18, rank: 0, kind: exception}
  - {phase: validation, step: 25, rank: 1, kind: hang}
  - {phase: shutdown, rank: 0, kind: exception}
"""


def _run(run_dir: Path, plan: Path | None) -> str:
    env = worker_env(UNBROKEN_MAX_RANK_FAULTS="20", UNBROKEN_PHASE_TIMEOUTS="validation=1")
    if plan is not None:
        env["UNBROKEN_FAULTS"] = str(plan)
    cmd = unbroken_run_cmd(
        run_dir,
        nproc=2,
        steps=None,
        target=[str(EXAMPLE)],
        launcher_args=["--max-restarts", "3", "--ft-steady-timeout-s", "10"],
    )
    res = run(cmd, timeout_s=300, env=env)
    assert res.returncode == 0, res.output[-4000:]
    hashes = res.hashes()
    assert len(hashes) == 1, res.output[-4000:]
    return hashes[0]


def test_a_fault_in_every_phase_is_recovered_bit_exact(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    clean = _run(tmp_path / "clean", None)
    assert _run(tmp_path / "faulted", plan) == clean
    report = goodput.compute(read_run(tmp_path / "faulted").events)
    by_phase = {f.phase: f for f in report.faults if f.injected}
    assert set(by_phase) == {
        "init",
        "restore",
        "data",
        "recovery",
        "save",
        "persist",
        "validation",
        "shutdown",
    }
    for phase, f in by_phase.items():
        assert f.detection_s is not None, phase
        assert f.recovery_s is not None and f.steps_lost is not None, phase
    assert by_phase["shutdown"].steps_lost == 0  # after the last step: the job's end resumes it
    assert by_phase["save"].layer == "launcher" and by_phase["save"].fault_class == "crash"
    assert by_phase["validation"].fault_class == "hang"
    assert by_phase["validation"].detector == "watchdog"  # its phase's own timeout (1 s)
    assert report.by_phase["validation"].faults == 1
    assert report.fault_s > 0
