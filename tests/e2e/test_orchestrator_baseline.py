"""The Kubernetes-only baseline on the emulated cluster: a JobSet that recreates every pod."""

from __future__ import annotations

from pathlib import Path

import pytest

from once import once
from procs import final, run, train_cmd
from unbroken.bench.orchestrator import OrchestratorConfig, run_orchestrated, train_command
from unbroken.ledger import goodput, read_events

ARGS = ["--steps", "8", "--seq-len", "32", "--batch-size", "4"]


@pytest.fixture(scope="module")
def clean_hash(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """final_state_sha256 of the same job without faults."""

    def compute() -> str:
        ref = run(
            train_cmd(
                tmp_path_factory.mktemp("ref"), nproc=2, steps=8, extra=["--batch-size", "4"]
            ),
            timeout_s=120,
        )
        assert ref.returncode == 0, ref.output[-3000:]
        return ref.hashes()[0]

    return once(request, compute)


def test_sigkill_relaunches_the_whole_job_and_matches_a_clean_run(
    tmp_path: Path, clean_hash: str
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "faults:\n  - {step: 3, rank: 1, kind: sigkill}\n  - {step: 5, rank: 0, kind: exception}\n"
    )
    run_dir = tmp_path / "job"
    cfg = OrchestratorConfig(nproc=2, restart_delay_s=0.1, job_timeout_s=240)
    res = run_orchestrated(
        train_command([*ARGS, "--run-dir", str(run_dir), "--faults", str(plan)]),
        run_dir=run_dir,
        cfg=cfg,
    )
    assert res.returncode == 0, res.output[-3000:]
    assert res.launches == 3
    assert final(run_dir)["final_state_sha256"] == clean_hash
    rep = goodput.compute(read_events(run_dir))
    assert [(f.kind, f.layer) for f in rep.faults] == [
        ("sigkill", "orchestrator"),
        ("exception", "orchestrator"),
    ]
    # Each JobSet restart recreates the pods; they start after the pod start delay.
    delays = [e.get("delay_s") for e in read_events(run_dir) if e.kind == "restart_begin"]
    assert delays == [0.1, 0.1]
    assert all(
        f.recovery_s is not None and f.recovery_s > d
        for f, d in zip(rep.faults, delays, strict=True)
    )


def test_budget_exhausted_fails(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 1, rank: 0, kind: exception}\n")
    run_dir = tmp_path / "job"
    res = run_orchestrated(
        train_command([*ARGS, "--run-dir", str(run_dir), "--faults", str(plan)]),
        run_dir=run_dir,
        cfg=OrchestratorConfig(nproc=2, restart_delay_s=0.0, max_restarts=0),
    )
    assert res.returncode == 1 and res.launches == 1  # the exception's exit code
    assert [e.get("status") for e in read_events(run_dir) if e.kind == "job_end"] == ["failed"]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="restart_delay_s"):
        OrchestratorConfig(restart_delay_s=-1)
    with pytest.raises(ValueError, match="nproc"):
        OrchestratorConfig(nproc=0)


def test_a_hang_ends_by_the_survivors_collective_timeout(tmp_path: Path, clean_hash: str) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 2, rank: 0, kind: hang}\n")
    run_dir = tmp_path / "job"
    cfg = OrchestratorConfig(nproc=2, restart_delay_s=0.1, job_timeout_s=240)
    res = run_orchestrated(
        train_command(
            [*ARGS, "--run-dir", str(run_dir), "--faults", str(plan), "--pg-timeout-s", "2"]
        ),
        run_dir=run_dir,
        cfg=cfg,
    )
    assert res.returncode == 0, res.output[-3000:]
    # rank 1 timed out, the hung rank 0's pod was deleted, relaunched: once, or twice when the
    # relaunched pods start further apart than the 2 s timeout that also bounds forming the
    # group (seen on a loaded machine: the second pod's first store connect timed out)
    assert res.launches in (2, 3)
    assert final(run_dir)["final_state_sha256"] == clean_hash
    [fault] = goodput.compute(read_events(run_dir)).faults
    assert fault.kind == "hang" and fault.layer == "orchestrator"
    # The collective timeout (2 s), counted by the survivor from when it entered its collective,
    # which may be a few milliseconds before the hung rank recorded the injection.
    assert fault.detection_s is not None and fault.detection_s >= 1.9
