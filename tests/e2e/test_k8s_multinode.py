"""Multi-node recovery on the emulated Kubernetes cluster, each pod a network namespace.

The manifests are ``unbroken k8s render``'s (Indexed Job, headless Service, the rendezvous
store pod); 3 nodes x 2 ranks train the reference model; once rank 0 completed step
``AT_STEP`` a node is lost (its link goes down, then all its processes die). The job must end
with the fault-free run's ``final_state_sha256``, the survivors' agents never restarting.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from once import once
from procs import run, unbroken_run_cmd
from unbroken.bench.k8s import NodeLoss, NodeLossResult, emulated_cluster, run_node_loss
from unbroken.k8s.emulate.net import netns_unavailable
from unbroken.ledger import read_events

pytestmark = [
    pytest.mark.skipif(netns_unavailable() is not None, reason=f"{netns_unavailable()}"),
]

STEPS, AT_STEP = 16, 8
JOB = NodeLoss(steps=STEPS, at_step=AT_STEP, mode="netns", pod_restart_s=0.5, timeout_s=420)
FQDN = "{host}.ft.default.svc.cluster.local"


@pytest.fixture(scope="module")
def clean_hash(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """final_state_sha256 of the same training, fault-free, 6 ranks on one node."""

    def compute() -> str:
        ref = tmp_path_factory.mktemp("ref")
        extra = list(JOB.train_command()[JOB.train_command().index("--ckpt-every") :])
        res = run(unbroken_run_cmd(ref, nproc=6, steps=STEPS, extra=extra), timeout_s=300)
        assert res.returncode == 0, res.output[-3000:]
        return res.hashes()[0]

    return once(request, compute)


def _rounds(res: NodeLossResult) -> list[dict]:
    """Every agent's rendezvous record: round, group rank, host, master_addr, ts."""
    return [
        {"ts": e.ts, **e.data}
        for e in read_events(res.run_dir)
        if e.rank == -1 and e.kind == "phase" and e.get("name") == "rendezvous"
    ]


def _started(res: NodeLossResult, hostname: str) -> list[dict]:
    return [h for h in res.history if h["event"] == "pod_started" and h["hostname"] == hostname]


def _check_survivors_stayed_warm(res: NodeLossResult, lost: str) -> None:
    """Each survivor's agent process lived through the loss: one agent start per survivor pod,
    and its workers were restarted from its warm pool."""
    events = read_events(res.run_dir)
    agents = [e for e in events if e.rank == -1 and e.kind == "process_start"]
    survivors = {h["hostname"] for h in res.history if h["event"] == "pod_started"} - {lost}
    survivors -= {h for h in survivors if h.startswith("ft-rdzv")}
    for host in survivors:
        assert len(_started(res, host)) == 1, f"{host}'s pod was restarted"
        assert sum(e.get("host") == host for e in agents) == 1, f"{host}'s agent restarted"
    warm = [e.get("warm") for e in events if e.rank == -1 and e.kind == "restart_end"]
    assert warm and all(warm)


def _check_replaced(res: NodeLossResult, lost: str) -> tuple[str, str]:
    """The lost pod was ignored by podFailurePolicy (a disruption) and replaced with the same
    hostname and a new address; (old ip, new ip)."""
    [failed] = [h for h in res.history if h["event"] == "pod_failed"]
    assert failed["action"] == "Ignore" and failed["conditions"] == ["DisruptionTarget"]
    pods = _started(res, lost)
    assert len(pods) == 2
    assert pods[0]["index"] == pods[1]["index"] and pods[0]["ip"] != pods[1]["ip"]
    return pods[0]["ip"], pods[1]["ip"]


def test_losing_a_nonzero_index_waits_warm_for_the_replacement_pod(
    clean_hash: str, tmp_path: Path
) -> None:
    res = run_node_loss(dataclasses.replace(JOB, lose="index:1"), tmp_path)
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash
    assert res.lost_host == "ft-1" and res.recovery_s is not None
    _check_replaced(res, "ft-1")
    _check_survivors_stayed_warm(res, "ft-1")


def test_losing_index_0_keeps_the_job_and_its_replacement_is_found_by_name(
    clean_hash: str, tmp_path: Path
) -> None:
    """Index 0 hosted the round's worker store and sorts first: the rendezvous store lives in
    its own pod, so the survivors keep their rendezvous; the replacement gets a new address,
    becomes group rank 0 again, and the others reach its worker store by its DNS name."""
    res = run_node_loss(dataclasses.replace(JOB, lose="index:0"), tmp_path)
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash
    old_ip, new_ip = _check_replaced(res, "ft-0")
    _check_survivors_stayed_warm(res, "ft-0")
    assert res.lost_ts is not None
    before = [r for r in _rounds(res) if r["ts"] < res.lost_ts]
    after = [r for r in _rounds(res) if r["ts"] > res.lost_ts]
    assert {r["master_addr"] for r in before} == {FQDN.format(host="ft-0")}
    resumed = [r for r in after if r["group_rank"] == 0]
    assert resumed and {r["host"] for r in resumed} == {"ft-0"}
    assert {r["master_addr"] for r in after} == {FQDN.format(host="ft-0")}  # now at new_ip
    assert old_ip != new_ip


def test_a_hot_spare_takes_the_lost_nodes_place_without_waiting_for_kubernetes(
    clean_hash: str, tmp_path: Path
) -> None:
    """4 pods for 3 nodes: the one that came last waits as a spare. Lose the node of group
    rank 0; training resumes with the spare while the replacement pod is still 10 s away; the
    replacement then finds the job done (or waits as the new spare) and exits 0."""
    run_ = dataclasses.replace(
        JOB, spares=1, lose="group-rank:0", pod_restart_s=10.0, snapshot_every=1
    )
    res = run_node_loss(run_, tmp_path)
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash
    assert res.lost_ts is not None and res.lost_host is not None
    rounds = _rounds(res)
    first = {r["host"] for r in rounds if r["round"] == 0}
    [spare] = {f"ft-{i}" for i in range(4)} - first
    replacement = _started(res, res.lost_host)[1]
    resumed = [r for r in rounds if res.lost_ts < r["ts"] < replacement["ts"]]
    assert {r["host"] for r in resumed} == (first - {res.lost_host}) | {spare}
    assert res.recovery_s is not None and res.recovery_s < replacement["ts"] - res.lost_ts
    ends = [h for h in res.history if h["event"] == "pod_ended" and h["hostname"] == res.lost_host]
    assert [h["exit_code"] for h in ends] == [137, 0]  # lost; then the replacement, not needed
    # Zero rollback through the peer tier: the lost node's ranks restore the replica they sent
    # the next node, ranks that moved restore from the node that has them; none from disk.
    assert set(res.tiers) <= {"memory", "peer"} and res.tiers.get("peer", 0) >= 2, res.tiers
    assert res.steps_lost is not None and res.steps_lost <= 1
    # The surviving nodes kept their group ranks and handed their paused workers over to the
    # new round: the same processes (one process_start each) with the same ranks; only the
    # spare's two workers started, as ranks 0-1 (the lost node's).
    events = read_events(res.run_dir)
    starts = Counter(e.rank for e in events if e.kind == "process_start" and e.rank >= 0)
    handed = {
        e.rank for e in events if e.kind == "restart_end" and e.get("handover") and e.rank >= 0
    }
    assert handed == {2, 3, 4, 5}, handed
    assert starts == {0: 2, 1: 2, 2: 1, 3: 1, 4: 1, 5: 1}, starts


def test_a_drained_node_is_a_preemption_the_job_saves_at_then_goes_on_with_the_spare(
    clean_hash: str, tmp_path: Path
) -> None:
    """The pod of group rank 0 (the round's worker store on its node) is evicted, as draining
    its node does: SIGTERM, a grace period. Its agent tells the others; every rank saves the
    same step durably; the evicted node leaves the rendezvous without closing it, and the
    survivors go on with the spare from that step, no step trained twice, no lost node to
    notice through keep-alives, no restart budget used."""
    run_ = dataclasses.replace(JOB, spares=1, lose="group-rank:0", drain=True, snapshot_every=1)
    res = run_node_loss(run_, tmp_path)
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash
    assert res.lost_ts is not None and res.lost_host is not None
    events = read_events(res.run_dir)
    saves = [e for e in events if e.kind == "phase" and e.get("name") == "preemption"]
    assert {e.rank for e in saves} == set(range(6)) and all(e.get("durable") for e in saves)
    [saved] = {int(e.get("step")) for e in saves}
    steps = [int(e.get("step")) for e in events if e.kind == "step" and e.rank == 0]
    assert sorted(steps) == [s for s in range(STEPS) if s != saved]  # none twice; the saved
    # step's record is its save's (it raised Preempted before ``step_done``)
    causes = [e.get("cause") for e in events if e.rank == -1 and e.kind == "restart_begin"]
    assert causes and set(causes) == {"preemption"}
    assert not [e for e in events if e.kind == "fault_detected"]  # told, not detected
    ended = [h for h in res.history if h["event"] == "pod_ended" and h["hostname"] == res.lost_host]
    assert ended[0]["exit_code"] == 143 and "DisruptionTarget" in ended[0]["conditions"]
    _check_survivors_stayed_warm(res, res.lost_host)
    assert res.steps_lost == 0 and res.recovery_s is not None


def test_every_pod_evicted_at_once_the_job_saves_then_new_pods_resume_from_that_step(
    clean_hash: str, tmp_path: Path
) -> None:
    """The whole job stopped: every pod of the Job evicted at once (its pods deleted, every
    node drained). Every rank saves the same step durably before the grace runs out; the Job
    replaces the pods; the new ones form a new round and resume from that step: no step trained
    twice, the fault-free weights."""
    run_ = dataclasses.replace(JOB, lose="all", drain=True)
    res = run_node_loss(run_, tmp_path)
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash
    assert res.lost_ts is not None and res.lost_host == "all"
    events = read_events(res.run_dir)
    saves = [e for e in events if e.kind == "phase" and e.get("name") == "preemption"]
    assert {e.rank for e in saves} == set(range(6)) and all(e.get("durable") for e in saves)
    [saved] = {int(e.get("step")) for e in saves}
    steps = [int(e.get("step")) for e in events if e.kind == "step" and e.rank == 0]
    assert sorted(steps) == [s for s in range(STEPS) if s != saved]  # none twice
    # Every original pod ended evicted; every rank of the new pods restored the saved step.
    first_ends: dict[str, dict] = {}
    for h in res.history:
        if h["event"] == "pod_ended" and h["owner"] == "Job/ft":
            first_ends.setdefault(h["hostname"], h)
    assert set(first_ends) == {"ft-0", "ft-1", "ft-2"}
    assert all(h["exit_code"] == 143 for h in first_ends.values()), first_ends
    assert all("DisruptionTarget" in h["conditions"] for h in first_ends.values())
    loads = [e for e in events if e.kind == "ckpt_load" and e.ts > res.lost_ts]
    assert {e.rank for e in loads} == set(range(6)) and {e.get("step") for e in loads} == {saved}
    started = [h for h in res.history if h["event"] == "pod_started" and h["owner"] == "Job/ft"]
    assert len(started) == 6  # three pods, then their three replacements
    assert res.steps_lost == 0 and res.recovery_s is not None


def test_the_store_pod_lost_then_a_node_lost_the_job_continues(
    clean_hash: str, tmp_path: Path
) -> None:
    """No single point of failure: the rendezvous store's pod is lost (link down, processes
    killed) while the job trains; its Deployment replaces it, empty, at a new address; every
    agent re-joins it without restarting a worker; then a node is lost, and that fault is
    recovered like any other, to the fault-free weights."""
    run_ = dataclasses.replace(JOB, lose="index:1", lose_store_at_step=2)
    res = run_node_loss(run_, tmp_path)
    assert res.status == "Complete", res.history[-5:]
    assert res.final_state_sha256 == clean_hash
    stores = [h for h in res.history if h["event"] == "pod_started" and "rdzv" in h["hostname"]]
    assert len(stores) == 2 and stores[0]["ip"] != stores[1]["ip"]  # replaced, elsewhere
    assert res.store_lost_ts is not None and res.lost_ts is not None
    events = read_events(res.run_dir)
    rejoined = [e for e in events if e.kind == "rdzv_store" and e.get("state") == "rejoined"]
    assert {e.get("host") for e in rejoined} >= {"ft-0", "ft-1", "ft-2"}
    assert all(res.store_lost_ts < e.ts < res.lost_ts for e in rejoined)
    # Nothing restarted for the store: the only restart is the node's loss.
    restarts = [e for e in events if e.rank == -1 and e.kind == "restart_begin"]
    assert restarts and all(e.ts > res.lost_ts for e in restarts)
    _check_replaced(res, "ft-1")
    _check_survivors_stayed_warm(res, "ft-1")


def test_a_give_up_exit_code_fails_the_job_without_a_restart_loop(tmp_path: Path) -> None:
    """unbroken-run refuses its flags (exit 2): podFailurePolicy fails the Job at once; no pod
    is replaced and the other pods are deleted."""
    docs = JOB.objects()
    job = next(d for d in docs if d["kind"] == "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    args.insert(0, "--ft-heartbeat-interval-s=-1")
    (tmp_path / "volume").mkdir()
    cluster = emulated_cluster(
        tmp_path, volume=tmp_path / "volume", mode="netns", pod_start_delay_s=0.0
    )
    try:
        cluster.apply(docs)
        assert cluster.wait(120) == "Failed"
    finally:
        cluster.close()
    failed = [h for h in cluster.history if h["event"] == "pod_failed"]
    assert failed and failed[0]["exit_code"] == 2 and failed[0]["action"] == "FailJob"
    [outcome] = [h for h in cluster.history if h["event"] == "job_failed"]
    assert outcome["reason"] == "PodFailurePolicy"
    starts = [h for h in cluster.history if h["event"] == "pod_started" and h["owner"] == "Job/ft"]
    assert len(starts) == 3  # one per index, none replaced
