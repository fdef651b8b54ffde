"""A slow rank end to end: one of two ranks of the reference job under ``unbroken-run`` loses
most of its CPU for a few seconds (a real cpu cgroup quota). It must be reported as the
straggler (report, dashboard snapshot, alert, /metrics), restarted by nobody (neither the
in-process watchdog nor the launcher's heartbeat monitor), and the job must end bit-exact.

Why cpu 0.2 and not 0.5: on this 2-core machine, shared with other jobs, a rank already gets
about half a core, so a quota of half a core binds too rarely to be a test; a fifth of one
always does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from once import once
from procs import run, unbroken_run_cmd
from unbroken.dashboard.metrics import registry_for
from unbroken.dashboard.runs import RunSet
from unbroken.faults import slowrank
from unbroken.ledger import goodput, read_events

STEPS, AT_STEP, WINDOW_S, CPU = 70, 25, 5.0, 0.2
ARGS = ["--batch-size", "4"]
TIMEOUT_S = 240
pytestmark = pytest.mark.serial  # a CPU share: other tests beside it would be stragglers too


def _run(run_dir: Path, plan: Path | None) -> list[str]:
    extra = [*ARGS, *(["--faults", str(plan)] if plan else [])]
    res = run(unbroken_run_cmd(run_dir, nproc=2, steps=STEPS, extra=extra), timeout_s=TIMEOUT_S)
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


def _metrics(run_dir: Path) -> dict[str, dict[tuple, float]]:
    runs = RunSet(run_dir, record_alerts=False)
    try:
        text = generate_latest(registry_for(runs, refresh=True)).decode()
        snap = runs.all()[0].snapshot
    finally:
        runs.close()
    out: dict[str, dict[tuple, float]] = {"snapshot": snap}  # type: ignore[dict-item]
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def test_a_throttled_rank_is_a_straggler_and_is_not_restarted(
    reference: str, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"faults:\n  - {{step: {AT_STEP}, rank: 1, kind: slow-rank, cpu: {CPU}, "
        f"seconds: {WINDOW_S}}}\n"
    )
    run_dir = tmp_path / "run"
    assert _run(run_dir, plan) == [reference, reference]
    events = read_events(run_dir)

    # Nobody restarted anything: one attempt, one iteration, no detection.
    assert {e.attempt for e in events} == {0} and {e.iteration for e in events} == {0}
    assert not [e for e in events if e.kind in ("fault_detected", "restart_begin")]
    (injected,) = [e for e in events if e.kind == "fault_injected"]
    assert injected.get("fault") == "slow-rank" and injected.get("disruptive") is False
    assert injected.get("mechanism") == slowrank.mechanism()
    assert injected.get("window_s") == WINDOW_S and injected.get("cpu") == CPU
    # Every step record of both ranks says how busy its training thread was.
    steps = [e for e in events if e.kind == "step"]
    assert {e.rank for e in steps} == {0, 1}
    assert all(e.get("busy_s") is not None for e in steps)

    # The report names rank 1, in the window, and prices the window.
    rep = goodput.compute(events)
    start, end = injected.ts, injected.ts + WINDOW_S
    during = [x for x in rep.stragglers if x.begin_ts < end and x.end_ts > start]
    assert [x.rank for x in during] == [1], (rep.stragglers, _busy_in(steps, start, end))
    assert during[0].busy_ratio - during[0].others_ratio >= 0.25
    (fault,) = rep.faults
    assert fault.window_s == WINDOW_S and fault.downtime_s == 0.0
    assert rep.step_time_s_outside is not None and fault.step_s_inside is not None
    assert fault.step_s_inside > 1.5 * rep.step_time_s_outside
    assert fault.degraded_s is not None and fault.degraded_s > 0 and rep.degraded_s > 0

    # The dashboard and /metrics say the same.
    m = _metrics(run_dir)
    snap = m["snapshot"]
    assert 1 in [x["rank"] for x in snap["stragglers"]]  # type: ignore[index]
    assert any(
        a["name"] == "straggler" and a["labels"] == {"rank": "1"}
        for a in snap["alerts"]  # type: ignore[index]
    )
    assert m["unbroken_straggler_episodes_total"].get((("rank", "1"),), 0) >= 1
    assert set(m["unbroken_rank_busy_ratio"]) == {(("rank", "0"),), (("rank", "1"),)}
    assert m["unbroken_degraded_seconds_total"][()] == pytest.approx(rep.degraded_s)

    # Nothing left behind: the child cgroup is gone, and so is the watcher.
    if injected.get("cgroup"):
        assert not Path(str(injected.get("cgroup"))).exists()
    _gone(int(injected.get("watcher_pid")))


def _busy_in(steps: list, start: float, end: float) -> list[tuple]:
    """(rank, end from the injection, step s, busy share) of the steps in the window: what
    the straggler judge saw, for a failure to say."""
    return [
        (e.rank, round(e.ts - start, 2), round(e.dur_s, 3), round(e.get("busy_s") / e.dur_s, 2))
        for e in steps
        if start <= e.ts <= end + 1.0 and e.dur_s
    ]


def _gone(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return
        assert time.monotonic() < deadline, f"the watcher {pid} outlived the job"
        time.sleep(0.05)
