"""unbroken-run with the reference script: every fault recovers to a fault-free run's weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from once import once
from procs import run, train_cmd, unbroken_run_cmd, worker_env
from unbroken.launcher import errors, slowness
from unbroken.ledger import goodput, read_events

STEPS = 24
# The script's in-process restart layer is off: these tests are about the launcher's.
BATCH = ["--batch-size", "4", "--no-inprocess"]
WORKERS = Path(__file__).resolve().parents[1] / "workers_launcher"
TIMEOUT_S = 240


def _plan(tmp: Path, *entries: str) -> Path:
    plan = tmp / "plan.yaml"
    plan.write_text("faults:\n" + "".join(f"  - {e}\n" for e in entries))
    return plan


def _agent(events: list, kind: str) -> list:
    return [e for e in events if e.rank == -1 and e.kind == kind]


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    def compute() -> str:
        run_dir = tmp_path_factory.mktemp("reference")
        res = run(unbroken_run_cmd(run_dir, nproc=2, steps=STEPS, extra=BATCH), timeout_s=TIMEOUT_S)
        assert res.returncode == 0, res.output[-3000:]
        assert len(res.hashes()) == 2 and len(set(res.hashes())) == 1
        events = read_events(run_dir)
        assert not _agent(events, "fault_detected")
        assert _agent(events, "job_end")[0].get("status") == "ok"
        return res.hashes()[0]

    return once(request, compute)


def test_fault_free_run_matches_torchrun(reference: str, tmp_path: Path) -> None:
    res = run(train_cmd(tmp_path, nproc=2, steps=STEPS, extra=BATCH), timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]


@pytest.mark.parametrize(
    ("kind", "cause", "detector"),
    [
        ("sigkill", "sigkill", "exit"),
        ("exception", "exception", "exit"),
        ("hang", "hang", "heartbeat"),
    ],
)
def test_planned_fault_recovers_bit_exact(
    reference: str, tmp_path: Path, kind: str, cause: str, detector: str
) -> None:
    plan = _plan(tmp_path, f"{{step: 5, rank: 1, kind: {kind}}}")
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=STEPS,
        extra=[*BATCH, "--faults", str(plan)],
        launcher_args=["--max-restarts", "1", "--ft-steady-timeout-s", "2"],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]
    events = read_events(tmp_path)
    (detected,) = _agent(events, "fault_detected")
    assert (detected.get("cause"), detected.get("detector")) == (cause, detector)
    if kind == "hang":  # both ranks fall silent at the same step: either may be named
        assert {detected.get("fault_rank"), *detected.get("also_ranks")} <= {0, 1}
    else:
        assert detected.get("fault_rank") == 1
    assert {e.attempt for e in events if e.rank >= 0} == {0, 1}
    (fault,) = goodput.compute(events).faults
    assert fault.layer == "launcher" and fault.steps_lost == 6
    assert fault.recovery_s is not None and fault.detection_s is not None
    if kind == "hang":
        assert fault.detection_s >= 1.5


@pytest.mark.parametrize(("sig", "cause"), [("SIGSEGV", "segfault"), ("SIGSTOP", "hang")])
def test_signal_fault_recovers_bit_exact(
    reference: str, tmp_path: Path, sig: str, cause: str
) -> None:
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=STEPS,
        extra=BATCH,
        target=[str(WORKERS / "train_signal.py")],
        launcher_args=["--max-restarts", "1", "--ft-steady-timeout-s", "2"],
    )
    env = worker_env(TEST_SIGNAL=sig, TEST_SIGNAL_STEP="5", TEST_SIGNAL_RANK="1")
    res = run(cmd, timeout_s=TIMEOUT_S, env=env)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]
    events = read_events(tmp_path)
    # a stopped process is named as the culprit, from its state T
    assert [(e.get("cause"), e.get("fault_rank")) for e in _agent(events, "fault_detected")] == [
        (cause, 1)
    ]
    exits = {
        (e.get("worker_rank"), e.get("signal"))
        for e in _agent(events, "worker_exit")
        if e.attempt == 0
    }
    # a stopped process only dies of SIGKILL; the segfault is reported as such
    assert (1, "SIGKILL" if sig == "SIGSTOP" else "SIGSEGV") in exits


def test_budget_exhaustion_exits_with_error_file(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "{step: 2, rank: 1, kind: exception}")
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=STEPS,
        extra=[*BATCH, "--faults", str(plan)],
        launcher_args=["--max-restarts", "0"],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == errors.EXIT_BUDGET_EXHAUSTED, res.output[-3000:]
    record = json.loads((tmp_path / "error.json").read_text())
    assert (record["rank"], record["cause"], record["category"]) == (1, "exception", "user")
    assert record["reason"] == "restart_budget_exhausted" and record["exit_code"] == 1
    assert "InjectedFault" in record["message"]
    (end,) = _agent(read_events(tmp_path), "job_end")
    assert end.get("status") == "failed" and end.get("exit_code") == errors.EXIT_BUDGET_EXHAUSTED


def test_crash_loop_on_cold_starts_uses_up_the_budget(tmp_path: Path) -> None:
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=None,
        target=[str(WORKERS / "crash.py"), "7"],
        launcher_args=["--max-restarts", "2", "--no-ft-warm-pool"],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == errors.EXIT_BUDGET_EXHAUSTED, res.output[-3000:]
    record = json.loads((tmp_path / "error.json").read_text())
    assert (record["cause"], record["exit_code"], record["restarts"]) == ("exit_code", 7, 2)
    assert len(_agent(read_events(tmp_path), "worker_exit")) == 6


def test_no_progress_guard_stops_a_job_stuck_at_one_step(tmp_path: Path) -> None:
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=1,
        steps=None,
        target=[str(WORKERS / "stuck.py")],
        launcher_args=[
            "--max-restarts",
            "10",
            "--no-ft-warm-pool",
            "--ft-max-no-progress-restarts",
            "2",
        ],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == errors.EXIT_NO_PROGRESS, res.output[-3000:]
    record = json.loads((tmp_path / "error.json").read_text())
    assert record["reason"] == "no_progress" and record["restarts"] == 2


def test_ten_consecutive_kills_all_recover(reference: str, tmp_path: Path) -> None:
    """A kill at each of steps 1-10, alternating ranks: every restart meets the next fault at
    its first step."""
    plan = _plan(tmp_path, *(f"{{step: {s}, rank: {s % 2}, kind: sigkill}}" for s in range(1, 11)))
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=STEPS,
        extra=[*BATCH, "--faults", str(plan)],
        launcher_args=["--max-restarts", "10"],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]
    events = read_events(tmp_path)
    faults = goodput.compute(events).faults
    assert len(faults) == 10
    assert all(f.layer == "launcher" and f.recovery_s is not None for f in faults)
    assert _agent(events, "job_end")[0].get("restarts") == 10


def test_cold_starts_recover_bit_exact(reference: str, tmp_path: Path) -> None:
    plan = _plan(tmp_path, "{step: 5, rank: 0, kind: sigkill}")
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=STEPS,
        extra=[*BATCH, "--faults", str(plan)],
        launcher_args=["--max-restarts", "1", "--no-ft-warm-pool"],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]


def test_a_hang_in_native_code_is_the_launchers_to_recover(reference: str, tmp_path: Path) -> None:
    """In-process restart on: rank 1 blocks inside one native call, where no interrupt reaches
    it; its watchdog gives up at the hard timeout and the launcher restarts the workers. The
    ledger names the launcher as the layer that recovered it, not the in-process detection."""
    plan = _plan(tmp_path, "{step: 5, rank: 1, kind: hang-native}")
    extra = ["--batch-size", "4", "--faults", str(plan)]
    extra += ["--soft-timeout-s", "0.3", "--hard-timeout-s", "1.0"]
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=STEPS,
        extra=extra,
        launcher_args=["--max-restarts", "1", "--ft-steady-timeout-s", "5"],
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == [reference, reference]
    events = read_events(tmp_path)
    assert {e.attempt for e in events if e.rank >= 0} == {0, 1}
    (fault,) = goodput.compute(events).faults
    assert fault.kind == "hang-native" and fault.layer == "launcher", fault
    assert fault.recovery_s is not None


def _faults_detected(run_dir: Path) -> list[dict]:
    return [
        r
        for p in (run_dir / "events").glob("*.jsonl")
        for r in map(json.loads, p.read_text().splitlines())
        if r["kind"] == "fault_detected"
    ]


@pytest.mark.parametrize("mode", ["slow", "hung"])
def test_a_silent_node_is_hung_only_when_nothing_computes(mode: str, tmp_path: Path) -> None:
    """0.5 s steady timeout, 1 s of silence: a rank that computes through it (the others wait
    on it) is a slow step, not a hang; ranks that all wait are hung, caught long before their
    30 s sleep ends."""
    seconds = "1.0" if mode == "slow" else "30"
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=None,
        target=[str(WORKERS / "silent.py"), mode, seconds],
        launcher_args=[
            "--max-restarts",
            "0",
            "--ft-steady-timeout-s",
            "0.5",
            "--ft-heartbeat-interval-s",
            "0.05",
        ],
    )
    res = run(cmd, timeout_s=25)
    detected = _faults_detected(tmp_path)
    if mode == "slow":
        assert res.returncode == 0, res.output[-3000:]
        assert detected == [] and "slow, not hung" in res.output
    else:
        assert res.returncode == 3, res.output[-3000:]
        assert {r["cause"] for r in detected} == {"hang"}, detected
        cores = [
            float(m)
            for r in detected
            for m in re.findall(r"waited to run ([0-9.]+) of the time", r["message"])
        ]
        assert cores and max(cores) < slowness.BUSY_CORES, detected
