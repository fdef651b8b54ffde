"""The examples as a user runs them: under unbroken-run on 2 ranks, through an exception and a
SIGKILL, ending with the weights of a fault-free run, bit for bit.

The plain scripts are fault-free references and run unchanged; the adopted scripts get their
faults from a plan in ``UNBROKEN_FAULTS`` (``unbroken.run`` fires it from ``ctx.step_done``; the
script has no fault code); the plain DDP script gets the same plan through the observer
(``python -m unbroken.observe``: its optimizer steps are the plan's steps) and runs untouched. Five 2-rank runs of a
40-step tiny model: ~40 s on an idle 2-core machine. A script nobody here wrote (pytorch/examples'
FSDP2 example, adopted): test_upstream_example.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from once import once
from procs import run, unbroken_run_cmd, worker_env
from unbroken.ledger import goodput, read_events, read_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STEPS = 40
# An exception (in-process restart; step 15, noted, rescued from the live state), then a SIGKILL
# (the launcher restarts both workers; they resume from the memory the node agent's keeper
# held: the script never named the keeper).
PLAN = """faults:
  - {step: 15, rank: 0, kind: exception}
  - {step: 32, rank: 1, kind: sigkill}
"""


def _run(run_dir: Path, target: list[str], *, faults: Path | None = None) -> str:
    env = worker_env()
    if faults is not None:
        env["UNBROKEN_FAULTS"] = str(faults)
    cmd = unbroken_run_cmd(
        run_dir, nproc=2, steps=None, target=target, launcher_args=["--max-restarts", "3"]
    )
    res = run(cmd, timeout_s=240, env=env)
    assert res.returncode == 0, res.output[-4000:]
    hashes = res.hashes()
    assert len(hashes) == 1, res.output[-4000:]  # rank 0 prints it once, at the very end
    return hashes[0]


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(PLAN)
    return path


@pytest.fixture(scope="module")
def fault_free(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The hash of each plain script's fault-free run (they run unchanged under unbroken-run)."""

    def compute() -> dict[str, str]:
        return {
            name: _run(tmp_path_factory.mktemp(name), [str(EXAMPLES / f"plain_{name}.py")])
            for name in ("fsdp", "ddp")
        }

    return once(request, compute)


@pytest.mark.parametrize("name", ["fsdp", "ddp"])
def test_adopted_example_recovers_bit_exact(
    name: str, tmp_path: Path, plan: Path, fault_free: dict[str, str]
) -> None:
    run_dir = tmp_path / name
    digest = _run(run_dir, [str(EXAMPLES / f"{name}.py")], faults=plan)
    assert digest == fault_free[name]

    # The report of a user's script has the figures of the reference job's.
    rep = goodput.compute(read_run(run_dir).events)
    assert rep.steps_completed == STEPS
    assert rep.num_attempts == 2  # the SIGKILL: one launcher restart
    assert rep.num_iterations >= 2  # the exception: an in-process restart
    faults = {f.kind: f for f in rep.faults}
    assert set(faults) == {"exception", "sigkill"}
    assert all(f.injected and f.recovery_s is not None for f in rep.faults)
    assert faults["exception"].layer == "inprocess"
    assert faults["exception"].restore_tier == "memory"  # the failed iteration's snapshot
    # maybe_save noted step 15 before ctx.step_done fired the fault: rescued, nothing redone.
    assert faults["exception"].restored_step == 15 and faults["exception"].steps_lost == 0
    assert faults["sigkill"].restore_tier == "memory"  # the agent's keeper held it
    assert faults["sigkill"].layer == "launcher"
    if name == "ddp":
        # The surviving rank rescued step 32 before the agent stopped it; the killed rank's
        # new process took the replicated model and optimizers from it and its own values
        # (the generators) from its journal: nothing redone.
        assert faults["sigkill"].restored_step == 32 and faults["sigkill"].steps_lost == 0
    else:
        # FSDP shards differ by rank: the keeper holds the killed rank's one snapshot, the
        # newest step it staged: the save of step 29, or of a later step when the writer still
        # wrote step 19's from that copy at step 29 (the ranks then agree to stage it a step
        # later, and a machine busy enough holds it back past the kill: step 19 again).
        staged = [
            int(e.get("step"))
            for e in read_events(run_dir)
            if e.kind == "ckpt_stage" and e.rank == 1 and e.attempt == 0 and "durable" in e.data
        ]
        assert faults["sigkill"].restored_step == max(staged) >= 19, staged
    # The Checkpointer recorded into the active ledger without being handed it.
    assert rep.checkpoint_save_s > 0 and rep.checkpoint_efficiency is not None
    assert rep.checkpoint_efficiency < 1.0
    # ctx.step_done sent the launcher's heartbeats (a steady gap needs two of them 50 ms
    # apart between faults: not every run of these short steps has one).
    observed = json.loads((run_dir / "launcher" / "heartbeats.json").read_text())
    assert observed["job_heartbeats"] and observed["initial_samples"] >= 2


def test_plain_script_restarts_unchanged_bit_exact(
    tmp_path: Path, plan: Path, fault_free: dict[str, str]
) -> None:
    run_dir = tmp_path / "plain_ddp"
    digest = _run(run_dir, ["-m", "unbroken.observe", str(EXAMPLES / "plain_ddp.py")], faults=plan)
    assert digest == fault_free["ddp"]
    rep = goodput.compute(read_run(run_dir).events)
    assert sorted(f.kind for f in rep.faults) == ["exception", "sigkill"]
    assert {f.layer for f in rep.faults} == {"launcher"}  # no in-process restart in it
    assert rep.num_attempts == 3
