"""A degraded network on the emulated cluster: two pods (one rank each) train the reference
model; after step ``AT_STEP`` (the launchers' hang timeouts are calibrated by then) the link
between them delays every packet 50 ms each way and drops 1% of them for a few seconds, as
real packets through a user-space forwarder. The job must go on (no restart, neither by the
launcher nor in-process: a collective crawling over a slow link is slow, not hung), end
bit-exact, and the ledger must hold the
window and what it cost."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from once import once
from procs import run, unbroken_run_cmd
from unbroken.bench.k8s import NodeLoss, run_node_loss
from unbroken.k8s.emulate.net import netns_unavailable
from unbroken.ledger import goodput, read_events

pytestmark = [
    pytest.mark.skipif(netns_unavailable() is not None, reason=f"{netns_unavailable()}"),
]

STEPS, AT_STEP, WINDOW_S = 50, 25, 10.0
JOB = NodeLoss(nodes=2, nproc=1, lose=None, steps=STEPS, mode="netns", pod_restart_s=0.0)


@pytest.fixture(scope="module")
def clean_hash(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """final_state_sha256 of the same training, fault-free, 2 ranks on one node."""

    def compute() -> str:
        ref = tmp_path_factory.mktemp("ref")
        cmd = JOB.train_command()
        extra = cmd[cmd.index("--ckpt-every") :]
        res = run(unbroken_run_cmd(ref, nproc=2, steps=STEPS, extra=extra), timeout_s=300)
        assert res.returncode == 0, res.output[-3000:]
        return res.hashes()[0]

    return once(request, compute)


def test_a_slow_lossy_link_slows_the_job_and_restarts_nothing(
    clean_hash: str, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"faults:\n  - {{step: {AT_STEP}, rank: 0, kind: network, delay_ms: 50, loss: 1, "
        f"seconds: {WINDOW_S}}}\n"
    )
    # With in-process restart on (the emulated cluster's default): its watchdog, too, must see
    # a crawling collective (it sends) as slow, not hung.
    job = dataclasses.replace(JOB, train_args=(*JOB.train_args, "--faults", str(plan)))
    res = run_node_loss(job, tmp_path / "work")
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash

    # The link was degraded between the two pods, with real packets, then restored.
    [degraded] = [h for h in res.history if h["event"] == "link_degraded"]
    [restored] = [h for h in res.history if h["event"] == "link_restored"]
    assert degraded["pod"].startswith("ft-0") and degraded["peers"][0].startswith("ft-1")
    assert (degraded["delay_ms"], degraded["loss"]) == (50.0, 1.0)
    assert restored["forwarded"] > 100 and restored["dropped"] >= 1
    assert restored["ts"] - degraded["ts"] >= WINDOW_S

    events = read_events(res.run_dir)
    assert not [e for e in events if e.kind in ("fault_detected", "restart_begin")]
    assert {e.attempt for e in events} == {0}
    assert len([h for h in res.history if h["event"] == "pod_started"]) == 3  # 2 nodes + store
    (injected,) = [e for e in events if e.kind == "fault_injected"]
    assert injected.get("applied") is True and injected.get("pods") == ["ft-1"]
    assert injected.get("disruptive") is False
    assert 0 < injected.get("window_s") <= WINDOW_S

    # What it cost, from the ledger.
    rep = goodput.compute(events)
    (fault,) = rep.faults
    assert fault.kind == "network" and fault.downtime_s == 0.0
    assert rep.step_time_s_outside is not None and fault.step_s_inside is not None
    assert fault.step_s_inside > 2 * rep.step_time_s_outside
    assert rep.degraded_s > 0 and rep.infra_goodput == 1.0
