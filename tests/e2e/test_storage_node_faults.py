"""slow-storage, checkpoint-corruption and node-loss end to end: each ends bit-exact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from once import once
from procs import run, unbroken_run_cmd
from unbroken.ledger import goodput, read_events

STEPS = 24
ARGS = ["--batch-size", "4", "--no-inprocess", "--ckpt-every", "4"]
TIMEOUT_S = 240


def _plan(tmp: Path, entry: str) -> Path:
    plan = tmp / "plan.yaml"
    plan.write_text(f"faults:\n  - {entry}\n")
    return plan


def _run(run_dir: Path, plan: Path | None, *launcher_args: str, extra: list[str] = ()) -> list[str]:
    extra = [*ARGS, *extra, *(["--faults", str(plan)] if plan else [])]
    cmd = unbroken_run_cmd(
        run_dir, nproc=2, steps=STEPS, extra=extra, launcher_args=list(launcher_args)
    )
    res = run(cmd, timeout_s=TIMEOUT_S)
    assert res.returncode == 0, res.output[-3000:]
    assert len(res.hashes()) == 2, res.output[-3000:]
    return res.hashes()


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    def compute() -> str:
        hashes = _run(tmp_path_factory.mktemp("reference"), None)
        assert len(set(hashes)) == 1
        return hashes[0]

    return once(request, compute)


def test_slow_storage_skips_saves_and_restarts_nothing(reference: str, tmp_path: Path) -> None:
    # Fired at a step that saves nothing: no save is in flight, the next ones are slowed.
    plan = _plan(tmp_path, "{step: 1, rank: 0, kind: slow-storage, mbps: 2, saves: 2, ranks: all}")
    assert _run(tmp_path, plan) == [reference, reference]
    events = read_events(tmp_path)
    assert {e.attempt for e in events} == {0}  # no restart of any kind
    assert not [e for e in events if e.kind in ("fault_detected", "restart_begin")]
    # The first two saves each writer started were capped at 2 MB/s (their records say so) and
    # really were that slow (one alone when it outlasted training); saves due meanwhile were
    # skipped.
    (injected,) = [e for e in events if e.kind == "fault_injected"]
    for rank in (0, 1):
        persists = sorted(
            (e for e in events if e.kind == "ckpt_persist" and e.rank == rank),
            key=lambda e: e.begin,
        )
        caps = [e.get("throttle_bytes_per_s") for e in persists]
        assert persists[0].begin > injected.ts, (persists[0], injected)
        assert all(c == 2e6 for c in caps[:2]) and all(c == 0 for c in caps[2:]), caps
        for e in persists[:2]:
            assert e.dur_s >= 0.8 * e.get("bytes") / 2e6, e
    skipped = {e.get("step") for e in events if e.kind == "ckpt_skip"}
    assert skipped
    report = goodput.compute(events)
    (fault,) = report.faults
    assert fault.kind == "slow-storage" and not fault.disruptive
    assert fault.downtime_s == 0.0 and fault.ckpt_skips == len(skipped)
    assert report.infra_goodput == 1.0 and report.badput_s["recovery"] == 0.0


def test_corrupt_checkpoint_is_rejected_and_the_previous_one_restored(
    reference: str, tmp_path: Path
) -> None:
    plan = _plan(tmp_path, "{step: 13, rank: 1, kind: checkpoint-corruption}")
    # Off, the memory the agent keeps would restore step 11 without reading the disk. Every
    # save persists (a save due while the last persists waits for it, not skipped: a writer
    # starved on a busy machine had skipped both 7 and 11), so step 3 or 7 is there to fall
    # back to.
    extra = ["--no-memory-tier", "--ckpt-on-busy", "wait"]
    assert _run(tmp_path, plan, "--max-restarts", "1", extra=extra) == [reference, reference]
    events = read_events(tmp_path)
    (injected,) = [e for e in events if e.kind == "fault_injected"]
    ckpt = Path(injected.get("checkpoint"))  # step-11, or step-7 while 11 still persists
    corrupted = int(ckpt.name.removeprefix("step-"))
    assert corrupted in (7, 11) and injected.get("file") == str(ckpt / "__1_0.distcp")
    loads = [e for e in events if e.kind == "ckpt_load" and e.attempt == 1]
    assert len(loads) == 2  # both ranks agreed
    assert all(e.get("rejected") == [corrupted] for e in loads)
    restored = loads[0].get("step")
    assert restored is not None and restored < corrupted and loads[1].get("step") == restored
    fails = [e for e in events if e.kind == "ckpt_fail" and e.get("phase") == "load"]
    assert fails and all("checksum mismatch" in e.get("error") for e in fails)
    (fault,) = goodput.compute(events).faults
    assert fault.layer == "launcher" and fault.restored_step == restored
    assert fault.steps_lost == 13 - restored


def _staged(e, rank: int) -> bool:
    """A durable save staged by ``rank`` (not a snapshot, a note or a skip)."""
    return e.kind == "ckpt_stage" and e.rank == rank and e.get("durable") is True


def test_node_loss_is_relaunched_by_the_emulated_orchestrator(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "{step: 9, rank: 1, kind: node-loss}")
    out = tmp_path / "bench"
    res = run(
        [
            sys.executable,
            "-m",
            "unbroken.cli",
            "bench",
            "recovery",
            "--configs",
            "launcher",
            "--plan",
            str(plan),
            "--steps",
            "20",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--ckpt-every",
            "4",
            "--pod-restart-s",
            "0.2",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "rows.json"),
        ],
        timeout_s=TIMEOUT_S,
    )
    assert res.returncode == 0, res.output[-4000:]
    rows = {r["config"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert rows["launcher"]["matches_clean"] and rows["launcher"]["returncode"] == 0
    events = read_events(out / "launcher")
    (injected,) = [e for e in events if e.kind == "fault_injected"]
    assert injected.get("scope") == "agent" and injected.get("found_by") == "env"
    (fault,) = goodput.compute(events).faults
    assert (fault.kind, fault.detector, fault.layer) == (
        "node-loss",
        "orchestrator",
        "orchestrator",
    )
    # A save every rank staged before the node was lost, and none older than the newest the
    # ledger saw committed (steps 3 and 7, unless the writer was slower than the training: a
    # busy machine; a commit made as the node went down may be on disk, its record not).
    committed = [
        int(e.get("step")) for e in events if e.kind == "ckpt_commit" and e.ts < injected.ts
    ]
    staged = [
        {int(e.get("step")) for e in events if _staged(e, rank) and e.ts < injected.ts}
        for rank in (0, 1)
    ]
    restored, newest = fault.restored_step, max(committed, default=None)
    if restored is None:
        assert newest is None, committed
    else:
        assert restored in staged[0] & staged[1] and restored >= (newest or 0), (committed, staged)
    assert fault.recovery_s is not None and fault.recovery_s > 0.2
    # the agent of the lost node never saw it: nothing detected it but the orchestrator
    assert [e.get("detector") for e in events if e.kind == "fault_detected"] == ["orchestrator"]
