"""Calibrated hang timeouts with no timeout flag anywhere: the reference script (2 ranks, tiny
model, steps of ~tens of ms) under ``unbroken-run``.

- a clean run calibrates both layers (ledger ``tuned`` records) and nothing fires;
- a Python hang is caught by the in-process watchdog about a second after it starts (far
  below the old 60 s default), the launcher's calibrated timeout does not kill the restarting
  workers (no launcher restart), and the run ends bit-exact with the clean one, although it
  saved at the steps the adaptive interval (``--ckpt-adaptive``) chose instead of every 10.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from once import once
from procs import run, unbroken_run_cmd
from unbroken.ledger import read_events

STEPS = 40
HANG_STEP = 28  # after the warm-ups: 20 gaps in-process, 20 heartbeat gaps at the launcher
OLD_DEFAULT_S = 60.0
BOUND_S = 5.0


def _train(run_dir: Path, *extra: str) -> list[str]:
    return unbroken_run_cmd(
        run_dir, nproc=2, steps=STEPS, extra=["--batch-size", "4", "--ckpt-every", "10", *extra]
    )


@pytest.fixture(scope="module")
def clean(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    def compute() -> tuple[str, str]:
        run_dir = tmp_path_factory.mktemp("clean") / "run"
        res = run(_train(run_dir), timeout_s=180)
        assert res.returncode == 0, res.output[-4000:]
        (digest,) = set(res.hashes())
        return str(run_dir), digest

    run_dir, digest = once(request, compute)
    return Path(run_dir), digest


def test_a_clean_run_calibrates_both_layers_and_nothing_fires(clean: tuple[Path, str]) -> None:
    run_dir, _ = clean
    events = read_events(run_dir)
    assert [e for e in events if e.kind in ("fault_detected", "restart_begin")] == []
    assert {e.attempt for e in events} == {0}
    soft = {e.rank: e.get("value") for e in events if e.get("name") == "soft_timeout_s"}
    assert set(soft) == {0, 1}, soft  # each rank calibrated its own watchdog...
    assert all(v < BOUND_S for v in soft.values()), soft  # ...to about a second
    steady = [e.get("value") for e in events if e.get("name") == "steady_timeout_s"]
    assert steady and steady[-1] < 120.0, steady  # the launcher's too
    assert (run_dir / "calibration" / "rank1.json").is_file()


def test_a_hang_is_detected_in_about_a_second_without_timeout_flags(
    clean: tuple[Path, str], tmp_path: Path
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"faults:\n  - {{step: {HANG_STEP}, rank: 1, kind: hang}}\n")
    run_dir = tmp_path / "run"
    adaptive = ["--ckpt-adaptive", "--ckpt-mtbf-s", "2", "--ckpt-min-every", "3"]
    res = run(_train(run_dir, "--faults", str(plan), *adaptive), timeout_s=180)
    assert res.returncode == 0, res.output[-4000:]
    assert set(res.hashes()) == {clean[1]}  # bit-exact with the clean run
    events = read_events(run_dir)
    intervals = [e.get("value") for e in events if e.get("name") == "ckpt_interval_steps"]
    assert intervals and all(3 <= v <= 1000 for v in intervals), intervals
    # Saves fell due at the adaptive interval's steps, not the fixed schedule's: staged, or
    # skipped while an earlier one still persisted (the writer gets what two busy ranks on two
    # cores leave it: a save may persist for a second or more, so its commits may be few).
    due = {
        e.get("step")
        for e in events
        if e.kind == "ckpt_skip" or (e.kind == "ckpt_stage" and e.get("durable") is True)
    }
    assert due - {9, 19, 29, 39}, due
    assert {e.attempt for e in events} == {0}, "the launcher restarted the workers"
    (injected,) = [e for e in events if e.kind == "fault_injected"]
    detected = [e for e in events if e.kind == "fault_detected" and e.get("detector") == "watchdog"]
    assert detected, [e.to_dict() for e in events if e.kind == "fault_detected"]
    latency = min(e.ts for e in detected) - injected.ts
    assert 0 < latency < BOUND_S < OLD_DEFAULT_S, latency
