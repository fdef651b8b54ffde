"""The memory tiers end to end, under unbroken-run with the reference script (tiny model, two
ranks, a snapshot after every step, a durable save every 4): an exception restores from the
process's own memory and loses no step, also between snapshots (the step rescued as the
worker unwinds); a SIGKILL restores from the memory the agent kept for
the dead rank; a corrupt memory falls back to disk. Each ends bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from once import once
from procs import run, unbroken_run_cmd
from unbroken.ledger import goodput, read_events

STEPS = 10
ARGS = ["--batch-size", "4", "--ckpt-every", "4", "--snapshot-every", "1"]
TIMEOUT_S = 240
WORKERS = Path(__file__).resolve().parents[1] / "workers"


def _run(run_dir: Path, *extra: str, target: list[str] | None = None) -> list[str]:
    cmd = unbroken_run_cmd(
        run_dir,
        nproc=2,
        steps=STEPS,
        extra=[*ARGS, *extra],
        launcher_args=["--max-restarts", "2"],
        **({"target": target} if target else {}),
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert len(res.hashes()) == 2, res.output[-3000:]
    return res.hashes()


def _plan(tmp: Path, entry: str) -> str:
    plan = tmp / "plan.yaml"
    plan.write_text(f"faults:\n  - {entry}\n")
    return str(plan)


def _loads(run_dir: Path) -> list:
    return [e for e in read_events(run_dir) if e.kind == "ckpt_load" and e.get("step") is not None]


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    def compute() -> str:
        hashes = _run(tmp_path_factory.mktemp("reference"))
        assert len(set(hashes)) == 1
        return hashes[0]

    return once(request, compute)


def test_an_exception_restores_the_last_step_from_memory(reference: str, tmp_path: Path) -> None:
    plan = _plan(tmp_path, "{step: 5, rank: 1, kind: exception}")
    assert _run(tmp_path, "--faults", plan) == [reference, reference]
    [fault] = goodput.compute(read_events(tmp_path)).faults
    assert (fault.layer, fault.restore_tier, fault.restored_step) == ("inprocess", "memory", 5)
    assert fault.steps_lost == 0
    assert {e.get("source") for e in _loads(tmp_path)} == {"process"}


def test_a_sigkill_restores_from_the_memory_the_agent_kept(reference: str, tmp_path: Path) -> None:
    """The kill lands a step after a snapshot (every 2 steps here, the first durable save at
    step 7): a SIGKILL right after a snapshot of the one copy per rank began would land in its
    copy, on a region already cleared, and leave that rank nothing in memory (the disk then
    serves); a snapshot due while the writer still persisted from that copy would be staged a
    step later, at the kill's step."""
    plan = _plan(tmp_path, "{step: 6, rank: 1, kind: sigkill}")
    extra = ("--faults", plan, "--snapshot-every", "2", "--ckpt-every", "8")
    assert _run(tmp_path, *extra) == [reference, reference]
    [fault] = goodput.compute(read_events(tmp_path)).faults
    assert (fault.layer, fault.restore_tier) == ("launcher", "memory"), fault
    assert (fault.restored_step, fault.steps_lost) == (5, 1), fault
    loads = _loads(tmp_path)
    assert {(e.rank, e.get("source")) for e in loads} == {(0, "keeper"), (1, "keeper")}
    assert all("checksums verified" in e.get("why") for e in loads), [e.data for e in loads]
    assert all(e.get("pooled") for e in loads), [e.data for e in loads]  # the warmed pool used


def test_a_fault_between_snapshots_rescues_the_step_it_interrupted(
    reference: str, tmp_path: Path
) -> None:
    """A snapshot every 3 steps: the exception after step 6 (a step only noted) unwinds every
    rank through its Checkpointer's abort, which snapshots step 6 from the live state
    (``rescue``): restored from the process's own memory, no step lost."""
    plan = _plan(tmp_path, "{step: 6, rank: 1, kind: exception}")
    assert _run(tmp_path, "--faults", plan, "--snapshot-every", "3") == [reference, reference]
    [fault] = goodput.compute(read_events(tmp_path)).faults
    assert (fault.layer, fault.restore_tier, fault.restored_step) == ("inprocess", "memory", 6)
    assert fault.steps_lost == 0
    assert {e.get("source") for e in _loads(tmp_path)} == {"process"}


def test_without_in_process_restart_the_faulted_rank_rescues(
    reference: str, tmp_path: Path
) -> None:
    """The same fault under --no-inprocess: the failing worker rescues step 6 into the memory
    the agent keeps. Its peer rescues step 6 too only when its next collective fails before
    the launcher's SIGTERM ends it (a race: the peer is in step 7's forward, or already past
    its optimizer step), or it starts that rescue and the SIGTERM cuts it short: the slot it
    was overwriting (step 2's) is then invalid and not offered. The restore takes the newest
    step both hold, bit-exact in every case."""
    plan = _plan(tmp_path, "{step: 6, rank: 1, kind: exception}")
    extra = ["--faults", plan, "--snapshot-every", "3", "--no-inprocess"]
    assert _run(tmp_path, *extra) == [reference, reference]
    [fault] = goodput.compute(read_events(tmp_path)).faults
    [load, *_] = _loads(tmp_path)
    held = load.get("memory")
    # The faulted rank rescued step 6 into its spare; its one snapshot is step 5's, or step
    # 3's save when step 5's snapshot came while the writer still wrote step 3 (one copy),
    # or step 6's, when that snapshot waited for the writer until step 6.
    assert held[1] in ([6, 5], [6, 3], [6]), load.data
    assert held[0] in ([5], [6, 5], [3], [6, 3], [6]), load.data
    assert (fault.layer, fault.restore_tier) == ("launcher", "memory")
    assert fault.restored_step == held[0][0] and fault.steps_lost == 6 - held[0][0]


def test_a_corrupt_memory_falls_back_to_disk(reference: str, tmp_path: Path) -> None:
    target = [str(WORKERS / "corrupt_memory.py"), "--corrupt-at", "5"]
    hashes = _run(tmp_path, "--ckpt-mode", "sync", target=target)
    assert hashes == [reference, reference]
    loads = _loads(tmp_path)
    assert [
        (e.rank, e.get("tier"), e.get("step")) for e in sorted(loads, key=lambda e: e.rank)
    ] == [
        (0, "disk", 3),
        (1, "disk", 3),
    ], [e.data for e in loads]
    assert all("fails its checksum" in e.get("why") for e in loads), [e.data for e in loads]
