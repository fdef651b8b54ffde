"""Two ranks of the reference workload under ``unbroken.restart.run``, launched as a launcher
would (LOCAL_RANK set), with faults on rank 0 and on rank 1. The proof of a recovery: the final
state hash equals a fault-free run's, bit for bit, and no launcher restart happened."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from once import once
from procs import VENV_BIN, worker_env
from procs import run as run_cmd
from unbroken.ledger import goodput, read_events
from workers.launch import Rank, describe, launch

STEPS = 8
WORKER = "restart_worker.py"


def train(run_dir: Path, *args: str, plan: str | None = None, **kw) -> list[Rank]:
    extra = ["--run-dir", str(run_dir), "--steps", str(STEPS), *args]
    if plan is not None:
        (run_dir.parent / f"{run_dir.name}.yaml").write_text(plan)
        extra += ["--faults", str(run_dir.parent / f"{run_dir.name}.yaml")]
    return launch(WORKER, extra, **kw)


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    def compute() -> str:
        ranks = train(tmp_path_factory.mktemp("ref") / "run")
        assert all(r.returncode == 0 for r in ranks), describe(ranks)
        (digest,) = set(ranks[0].hashes + ranks[1].hashes)
        return digest

    return once(request, compute)


def assert_recovered(ranks: list[Rank], run_dir: Path, expected: str, faults: int) -> None:
    assert [r.returncode for r in ranks] == [0, 0], describe(ranks)
    for r in ranks:
        assert r.hashes == [expected], describe(ranks)
        assert r.result["iterations"] == list(range(faults + 1)), describe(ranks)
        assert r.result["threads"] == [] and r.result["children"] == [], r.result
        assert not r.result["pg_initialized"]
    events = read_events(run_dir)
    assert {e.attempt for e in events} == {0}  # no launcher restart
    report = goodput.compute(events)
    assert len(report.faults) == faults, report.faults
    for fault in report.faults:
        assert fault.layer == "inprocess" and fault.recovery_s is not None, fault


def test_exceptions_on_rank_1_then_rank_0(reference: str, tmp_path: Path) -> None:
    """Rank 0 swallows the first interrupts (user code catching BaseException)."""
    plan = "faults:\n  - {step: 2, rank: 1, kind: exception}\n  - {step: 5, rank: 0, kind: exception}\n"
    ranks = train(tmp_path / "run", "--victim", "swallow", plan=plan)
    assert_recovered(ranks, tmp_path / "run", reference, faults=2)
    assert "VICTIM swallow caught=3" in ranks[0].output


def test_python_hangs_on_rank_0_then_rank_1(reference: str, tmp_path: Path) -> None:
    plan = "faults:\n  - {step: 2, rank: 0, kind: hang}\n  - {step: 5, rank: 1, kind: hang}\n"
    ranks = train(tmp_path / "run", "--soft", "1.5", plan=plan)
    assert_recovered(ranks, tmp_path / "run", reference, faults=2)
    causes = [
        (e.get("cause"), e.get("fault_rank"))
        for e in read_events(tmp_path / "run")
        if e.kind == "restart_end" and e.rank == 0
    ]
    assert causes == [("hang", 0), ("hang", 1)]


def test_stuck_in_a_collective_on_rank_1_then_rank_0(reference: str, tmp_path: Path) -> None:
    """A receive whose sender never comes; both ranks end up blocked in native code. Without a
    launcher store: rank 0 starts the coordination store process (and stops it)."""
    ranks = train(
        tmp_path / "run", "--soft", "1.5", "--hang-collective", "2:1,5:0", plan="", store="bare"
    )
    assert_recovered(ranks, tmp_path / "run", reference, faults=2)
    kinds = {e.get("cause") for e in read_events(tmp_path / "run") if e.kind == "restart_end"}
    assert kinds == {"stuck"}


def test_a_rank_failing_its_health_check_leaves_and_the_job_goes_on_smaller(
    tmp_path: Path,
) -> None:
    """Rank 1 raises after step 4 and fails FaultCountCheck(1); rank 0 continues alone from the
    checkpoint of step 3 (FSDP2 state saved by 2 ranks, resharded onto 1)."""
    plan = "faults:\n  - {step: 4, rank: 1, kind: exception}\n"
    ranks = train(tmp_path / "run", "--ckpt-every", "2", "--fault-count-check", "1", plan=plan)
    assert [r.returncode for r in ranks] == [0, 0], describe(ranks)
    assert ranks[1].result["status"].startswith("excluded") and ranks[1].hashes == []
    assert ranks[0].result["world"] == [2, 1] and len(ranks[0].hashes) == 1
    for r in ranks:
        assert r.result["threads"] == [] and r.result["children"] == [], r.result
    events = read_events(tmp_path / "run")
    loads = [e.get("step") for e in events if e.kind == "ckpt_load" and e.iteration == 1]
    assert loads == [3]
    # Bit for bit what one rank computes from that checkpoint.
    ckpt = tmp_path / "ckpt-3"
    shutil.copytree(tmp_path / "run" / "ckpt" / "step-3", ckpt / "step-3")
    single = train(
        tmp_path / "single",
        *(
            "--ckpt-every",
            "2",
            "--ckpt-dir",
            str(ckpt),
            "--ckpt-allow-foreign",
        ),  # run's, on purpose
        nproc=1,
    )
    assert single[0].returncode == 0, describe(single)
    assert single[0].hashes == ranks[0].hashes


def test_repeated_failure_escalates_on_every_rank(tmp_path: Path) -> None:
    plan = "faults:\n" + "".join(f"  - {{step: {s}, rank: 1, kind: exception}}\n" for s in (1, 2))
    ranks = train(tmp_path / "run", "--max-rank-faults", "2", plan=plan)
    assert [r.returncode for r in ranks] == [75, 75], describe(ranks)
    for r in ranks:
        assert "rank 1 caused 2 faults" in r.result["status"]
        assert r.result["threads"] == [] and r.result["children"] == []
    escalations = [e for e in read_events(tmp_path / "run") if e.kind == "escalate"]
    assert sorted(e.rank for e in escalations) == [0, 1]


def test_under_torchrun_an_exception_is_recovered_without_a_launcher_restart(
    reference: str, tmp_path: Path
) -> None:
    """torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True); --max-restarts 0."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 3, rank: 0, kind: exception}\n")
    worker = Path(__file__).resolve().parents[1] / "workers" / WORKER
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        str(worker),
        "--run-dir",
        str(tmp_path / "run"),
        "--steps",
        str(STEPS),
        "--faults",
        str(plan),
    ]
    res = run_cmd(cmd, timeout_s=180, env=worker_env(TORCH_CPP_LOG_LEVEL="ERROR"))
    assert res.returncode == 0, res.output[-4000:]
    assert res.hashes() == [reference, reference]
    report = goodput.compute(read_events(tmp_path / "run"))
    assert [f.layer for f in report.faults] == ["inprocess"] and report.num_attempts == 1


def test_a_restart_restores_the_in_memory_snapshot(reference: str, tmp_path: Path) -> None:
    """Saves after steps 1, 3, 5; rank 1 fails after step 4: both ranks restore step 3 from
    the snapshot their last iteration staged (no disk read) and end bit-exact."""
    plan = "faults:\n  - {step: 4, rank: 1, kind: exception}\n"
    ranks = train(tmp_path / "run", "--ckpt-every", "2", plan=plan)
    assert_recovered(ranks, tmp_path / "run", reference, faults=1)
    [fault] = goodput.compute(read_events(tmp_path / "run")).faults
    assert (fault.restore_tier, fault.restored_step, fault.steps_lost) == ("memory", 3, 1)


def test_a_hang_right_after_a_save_restores_that_save_from_memory(
    reference: str, tmp_path: Path
) -> None:
    """Rank 0 hangs after step 4, the step after the save of step 3, while rank 1 goes on into
    step 5's collectives: both still hold step 3."""
    plan = "faults:\n  - {step: 4, rank: 0, kind: hang}\n"
    ranks = train(tmp_path / "run", "--ckpt-every", "2", "--soft", "1.5", plan=plan)
    assert_recovered(ranks, tmp_path / "run", reference, faults=1)
    loads = [e for e in read_events(tmp_path / "run") if e.kind == "ckpt_load" and e.rank == 0]
    assert [(e.get("tier"), e.get("step"), e.get("memory")) for e in loads][-1][:2] == (
        "memory",
        3,
    ), [e.data for e in loads]
