"""``unbroken bench k8s``: a node lost from a 3-node job on the emulated Kubernetes cluster.

The job is rendered by ``unbroken k8s render`` (Indexed Job + headless Service + the store
pod) and run by the emulated cluster (``unbroken.k8s.emulate``: an emulation, so labelled),
which applies the ``network`` faults of a plan among the training arguments (``netfaults``);
once rank 0 completed step ``--at-step`` and every agent reached the rendezvous store (a spare
is waiting), one node is lost (its link goes down, then every process of it dies; the pod
gets ``DisruptionTarget``), or with ``--drain`` drained (its pod evicted: ``DisruptionTarget``,
SIGTERM, SIGKILL after the termination grace; a preemption every rank saves with, after which
the job goes on without the node). Configurations:

- ``clean``: no loss (the reference ``final_state_sha256`` and step time);
- ``spare``: one hot spare pod waits in the rendezvous and takes the lost node's place; every
  rank restores its newest snapshot from memory, its own node's or another's (the peer tier:
  the lost node's ranks from the replicas they sent the next node, ranks that moved to another
  node from the node that has them);
- ``spare-disk``: the same without the peer tier (``--no-peer-replica``): the ranks whose
  snapshots are not on their node restore from disk;
- ``spare-cold``: ``spare`` with the surviving nodes' workers stopped and started anew
  (``--no-ft-handover``) instead of handed over to the new round;
- ``replace``: no spare; Kubernetes replaces the pod after ``--pod-restart-s``, and the
  survivors wait for it, warm;
- ``baseline``: Kubernetes alone (a JobSet of torchrun pods, static rendezvous, no restarts
  inside the job): the lost pod fails the child Job, the JobSet recreates every pod after
  ``--pod-restart-s``.

Figures (from the run's ledger, with the goodput code every other figure uses): node loss ->
training again (``recovery_s``: the loss to every rank having completed a step; for a drain,
``drain_outage``), the steps lost and where each rank restored from (``tiers``). The unbroken
configurations snapshot to memory every ``--snapshot-every`` steps; clean and baseline never.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.bench.k8s_tail import LedgerTail, drain_outage, format_table
from unbroken.bench.k8s_workdir import fresh_workdir, not_ours
from unbroken.bench.netfaults import NetworkFaults
from unbroken.k8s import render
from unbroken.k8s import spec as kspec
from unbroken.k8s.emulate import Cluster, EmulationConfig
from unbroken.ledger import Ledger, goodput, read_events
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)

CLAIM = "ckpt"
MOUNT = "/checkpoints"
CONFIGS = ("clean", "spare", "spare-disk", "spare-cold", "replace", "baseline")
TERMINATION_GRACE_S = 20.0
"""The emulated pods' grace period (Kubernetes' default is 30 s): a drained pod's workers save
within it less 2 s, then its agent exits; six ranks on two loaded cores can need over 10 s."""


@dataclass(frozen=True, kw_only=True)
class NodeLoss:
    """One run: the job's shape, when and which node is lost, the cluster's timings."""

    name: str = "ft"
    """Job name (hostnames <name>-<index>)."""
    nodes: int = 3
    """Nodes the job trains on."""
    nproc: int = 2
    """Ranks per node."""
    spares: int = 0
    """Hot spare pods."""
    lose: str | None = "index:1"
    """"index:N" (the pod of index N), "group-rank:N" (the node of that rank in the current
    round), "all" (every pod of the Job at once: with ``drain``, the whole job stopped, as when
    its pods are deleted or every node is drained; the Job replaces them), or None (no loss)."""
    at_step: int = 10
    """The node is lost once rank 0 completed this step."""
    drain: bool = False
    """The node is drained instead of lost: its pod is evicted (SIGTERM, the termination
    grace), a preemption every rank saves with."""
    lose_store_at_step: int | None = None
    """Lose the rendezvous store's pod first, once rank 0 completed this step (None: never);
    the node is lost after every agent re-joined the store's replacement."""
    steps: int = 30
    """Training steps."""
    ckpt_every: int = 5
    """Steps between checkpoints."""
    snapshot_every: int = 0
    """Steps between memory-only snapshots (0: none)."""
    peer_replica: bool = True
    """Use the peer memory tier (False: ``--no-peer-replica``)."""
    handover: bool = True
    """Hand the surviving workers over to the next round (False: ``--no-ft-handover``)."""
    train_args: tuple[str, ...] = ("--seq-len", "32", "--batch-size", "4")
    """More arguments of the reference training script (the baseline adds ``--no-inprocess``:
    Kubernetes and torchrun alone restart no worker in-process)."""
    keep_alive_s: float = 0.5
    """Rendezvous keep-alive interval."""
    keep_alive_attempts: int = 4
    """Keep-alives missed before a node is dropped."""
    rdzv_poll_s: float = 0.05
    """Rendezvous poll interval."""
    membership_check_s: float = 0.1
    """How often running agents look for lost or waiting nodes."""
    baseline: bool = False
    """Kubernetes alone: a JobSet of torchrun pods instead of unbroken's manifests."""
    pod_restart_s: float = 1.0
    """Delay from a pod's creation to its container's start (replacements included)."""
    mode: str = "auto"
    """Emulation mode: netns, loopback or auto."""
    timeout_s: float = 600.0
    """The whole run is killed after this long."""

    def __post_init__(self) -> None:
        for name in ("nodes", "nproc", "steps", "keep_alive_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.spares < 0 or (self.spares and self.baseline):
            raise ValueError(f"spares must be >= 0, and 0 for the baseline, got {self.spares}")
        if self.lose is not None and not re.match(r"^(index|group-rank):\d+$|^all$", self.lose):
            raise ValueError(f"lose must be index:N, group-rank:N or all, got {self.lose!r}")
        if self.lose == "all" and self.baseline:
            raise ValueError("lose='all' is for unbroken's manifests, not the baseline")
        if not 0 <= self.at_step < self.steps:
            raise ValueError(f"at_step must be in [0, steps={self.steps}), got {self.at_step}")
        if self.lose_store_at_step is not None and (
            self.baseline or not 0 <= self.lose_store_at_step < self.at_step
        ):
            raise ValueError(
                "lose_store_at_step must be in [0, at_step) and the job unbroken's (the baseline "
                f"has no store pod), got {self.lose_store_at_step}"
            )
        for name in ("keep_alive_s", "rdzv_poll_s", "membership_check_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.pod_restart_s < 0:
            raise ValueError(f"pod_restart_s must be >= 0, got {self.pod_restart_s}")

    def train_command(self) -> list[str]:
        return [
            "-m",
            "unbroken.workload.train",
            "--steps",
            str(self.steps),
            "--run-dir",
            f"{MOUNT}/{self.name}",
            "--ckpt-every",
            str(self.ckpt_every),
            "--log-every",
            "5",
            *(["--snapshot-every", str(self.snapshot_every)] if self.snapshot_every else []),
            *([] if self.peer_replica else ["--no-peer-replica"]),
            *(["--no-inprocess"] if self.baseline else []),
            *self.train_args,
        ]

    def objects(self) -> list[dict[str, Any]]:
        """The manifests: unbroken's Indexed Job, or Kubernetes alone (baseline)."""
        if self.baseline:
            from unbroken.bench.orchestrator import baseline_objects

            return baseline_objects(
                name=self.name,
                nodes=self.nodes,
                nproc=self.nproc,
                command=self.train_command(),
                claim=CLAIM,
                mount=MOUNT,
                max_restarts=20,
            )
        spec = kspec.DeploySpec(
            name=self.name,
            image="emulated",
            command=(*([] if self.handover else ["--no-ft-handover"]), *self.train_command()),
            nodes=str(self.nodes),
            spares=self.spares,
            nproc_per_node=self.nproc,
            checkpoint_claim=CLAIM,
            checkpoint_mount=MOUNT,
            keep_alive_s=self.keep_alive_s,
            keep_alive_attempts=self.keep_alive_attempts,
            rdzv_poll_s=self.rdzv_poll_s,
            membership_check_s=self.membership_check_s,
            stop_grace_s=TERMINATION_GRACE_S - 2.0,  # a preemption's save (drain)
            termination_grace_s=int(TERMINATION_GRACE_S),
            join_timeout_s=int(self.timeout_s),
        )
        return render.objects(spec, "job")


@dataclass
class NodeLossResult:
    """How one run went."""

    status: str
    """The Job's (or JobSet's) end: Complete or Failed."""
    run_dir: Path
    """The job's run directory (ledger, checkpoints, final.json) on the emulated volume."""
    mode: str
    """netns or loopback."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The emulated cluster's record (pods started with their addresses, ended, decisions)."""
    lost_ts: float | None = None
    lost_host: str | None = None
    store_lost_ts: float | None = None
    """When the store's pod was lost (``lose_store_at_step``)."""
    recovery_s: float | None = None
    """Node loss -> every rank completed a step again (a drain: ``drain_outage``)."""
    steps_lost: int | None = None
    """Completed steps trained again after the loss."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Where the ranks restored from after the loss: tier (disk, memory, peer) -> ranks."""
    final_state_sha256: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)


def _target(run: NodeLoss, cluster: Cluster, tail: LedgerTail) -> str:
    assert run.lose is not None
    what, _, n = run.lose.partition(":")
    if what == "index" or (what == "group-rank" and run.baseline):  # static: rank = index
        prefix = f"{run.name}-node-0" if run.baseline else run.name
        return f"{prefix}-{int(n)}"
    if what == "group-rank":
        host = tail.host_of_group_rank(int(n))
        if host is None:
            raise RuntimeError(f"no rendezvous round names group rank {n}")
        return host
    raise ValueError(f"lose must be index:N or group-rank:N, got {run.lose!r}")


def emulated_cluster(
    workdir: Path, *, volume: Path, mode: str, pod_start_delay_s: float
) -> Cluster:
    """An emulated cluster whose ``unbroken-run``/``unbroken``/``torchrun`` are this Python's,
    which applies the network faults of the runs on ``volume`` (``netfaults``)."""
    py = sys.executable
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cluster = Cluster(
        workdir,
        cfg=EmulationConfig(mode=mode, pod_start_delay_s=pod_start_delay_s),
        commands={
            "unbroken-run": [py, "-m", "unbroken.launcher.cli"],
            "unbroken": [py, "-m", "unbroken.cli"],
            "torchrun": [py, "-m", "torch.distributed.run"],
        },
        volumes={CLAIM: volume},
        env=env,
    )
    NetworkFaults(cluster, volume)
    return cluster


def run_node_loss(run: NodeLoss, workdir: Path) -> NodeLossResult:
    """Run ``run`` on a fresh emulated cluster under ``workdir`` (an earlier run there is
    replaced: ``fresh_workdir``); the cluster is gone after."""
    fresh_workdir(workdir)
    volume = workdir / "volume"
    volume.mkdir()
    run_dir = volume / run.name
    cluster = emulated_cluster(
        workdir, volume=volume, mode=run.mode, pod_start_delay_s=run.pod_restart_s
    )
    tail = LedgerTail(run_dir)
    res = NodeLossResult(status="", run_dir=run_dir, mode=cluster.mode)
    deadline = time.monotonic() + run.timeout_s
    try:
        cluster.apply(run.objects())
        while run.lose is not None and res.lost_ts is None:
            if time.monotonic() > deadline or cluster.status() is not None:
                raise TimeoutError(
                    f"the job never reached step {run.at_step} (status {cluster.status()})"
                )
            tail.poll()
            store_at = run.lose_store_at_step
            if store_at is not None and res.store_lost_ts is None and tail.step(0) >= store_at:
                res.store_lost_ts = cluster.lose(cluster.pod(f"{run.name}-rdzv-0"))
            # A spare must be waiting in the rendezvous before a node is lost; a lost store
            # must have been re-joined by every agent.
            ready = run.baseline or len(tail.connected()) >= run.nodes + run.spares
            if store_at is not None:
                ready = ready and len(tail.rejoined()) >= run.nodes + run.spares
            if ready and tail.step(0) >= run.at_step:
                grace = TERMINATION_GRACE_S if run.drain else None
                if run.lose == "all":
                    res.lost_host = "all"
                    pods = cluster.running(owner=f"Job/{run.name}")
                    res.lost_ts = min(cluster.lose(p, evict_grace_s=grace) for p in pods)
                else:
                    res.lost_host = _target(run, cluster, tail)
                    res.lost_ts = cluster.lose(cluster.pod(res.lost_host), evict_grace_s=grace)
            time.sleep(0.01)
        if res.lost_ts is not None:
            ledger = Ledger(run_dir, run=run.name, rank=ev.LAUNCHER_RANK)
            ledger.emit(
                ev.FAULT_INJECTED,
                ts=res.lost_ts,
                fault="node-drain" if run.drain else "node-loss",
                step=run.at_step,
                node=res.lost_host,
                emulated=True,
            )
            ledger.close()
        res.status = cluster.wait(max(1.0, deadline - time.monotonic()))
    finally:
        cluster.close()
        res.history = list(cluster.history)
    final = run_dir / "final.json"
    if final.exists():
        res.final_state_sha256 = json.loads(final.read_text())["final_state_sha256"]
    try:
        events = read_events(run_dir)
        report = goodput.compute(events)
        res.figures = report.to_dict()
        if report.faults:
            res.recovery_s = report.faults[0].recovery_s
            res.steps_lost = report.faults[0].steps_lost
        if run.drain and res.lost_ts is not None:
            res.recovery_s = drain_outage(events, res.lost_ts)
        if res.lost_ts is not None:
            for e in events:
                if e.kind == "ckpt_load" and e.ts > res.lost_ts:
                    tier = str(e.get("tier"))
                    res.tiers[tier] = res.tiers.get(tier, 0) + 1
    except (FileNotFoundError, ValueError) as e:
        logger.error("no figures for %s: %s", run_dir, e)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=CONFIGS,
        help="configurations to run (clean always runs first)",
    )
    p.add_argument("--nodes", type=int, default=3, help="nodes the job trains on")
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--steps", type=int, default=40, help="training steps (tiny model)")
    p.add_argument(
        "--at-step", type=int, default=15, help="lose the node once rank 0 did this step"
    )
    p.add_argument(
        "--lose-store-at-step",
        type=int,
        metavar="N",
        help="first lose the rendezvous store's pod once rank 0 did step N (< --at-step); the "
        "node is lost once every agent re-joined its replacement",
    )
    p.add_argument(
        "--lose",
        default="group-rank:0",
        help="which node: index:N (a pod index), group-rank:N (a rank in the current round), "
        "or all (every pod of the Job at once)",
    )
    p.add_argument(
        "--drain",
        action="store_true",
        help="drain the node instead of losing it: its pod is evicted (SIGTERM, grace 10 s)",
    )
    p.add_argument(
        "--pod-restart-s",
        type=float,
        default=5.0,
        help="from a pod's creation to its container's start (scheduling, image): replacements",
    )
    p.add_argument(
        "--keep-alive-s",
        type=float,
        default=0.1,
        help="rendezvous keep-alive interval (0.1 s x 4 dropped no healthy node of the "
        "emulated cluster on 2 cores; on a real cluster, see docs/kubernetes.md)",
    )
    p.add_argument(
        "--keep-alive-attempts",
        type=int,
        default=4,
        help="keep-alives missed before a node is dropped (detection = interval x attempts)",
    )
    for flag, default, what in (
        ("--rdzv-poll-s", 0.05, "how often an agent waiting in the rendezvous looks at its state"),
        ("--membership-check-s", 0.1, "how often a running agent looks for lost or waiting nodes"),
    ):
        p.add_argument(flag, type=float, default=default, help=what)
    p.add_argument(
        "--mode",
        choices=["auto", "netns", "loopback"],
        default="auto",
        help="emulated pods: network namespaces (root) or process trees on loopback",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=1,
        help="memory-only snapshots every N steps in the unbroken configurations (0: none)",
    )
    p.add_argument("--out", default="runs/bench-k8s", help="output directory")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")


def main(a: argparse.Namespace) -> int:
    out = Path(a.out).resolve()
    rows = []
    clean_hash = None
    configs = ["clean", *[c for c in a.configs if c != "clean"]]
    store_at = a.lose_store_at_step
    if store_at is not None and not 0 <= store_at < a.at_step:  # before a run, not after one
        print(f"error: --lose-store-at-step must be in [0, --at-step={a.at_step})", file=sys.stderr)
        return 2
    polls = {"rdzv_poll_s": a.rdzv_poll_s, "membership_check_s": a.membership_check_s}
    try:  # before the first run: bad arguments and a foreign directory fail at once
        NodeLoss(lose=a.lose, drain=a.drain, steps=a.steps, at_step=a.at_step, **polls)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.lose == "all" and "baseline" in configs:
        print(
            "error: --lose all stops unbroken's job; leave baseline out of --configs",
            file=sys.stderr,
        )
        return 2
    for name in configs:
        why = not_ours(out / name)
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
    for name in configs:
        run = NodeLoss(
            nodes=a.nodes,
            nproc=a.nproc,
            steps=a.steps,
            at_step=a.at_step,
            lose_store_at_step=None if name in ("clean", "baseline") else a.lose_store_at_step,
            spares=1 if name.startswith("spare") else 0,
            snapshot_every=0 if name in ("clean", "baseline") else a.snapshot_every,
            peer_replica=name != "spare-disk",
            handover=name != "spare-cold",
            lose=None if name == "clean" else a.lose,
            drain=a.drain,
            baseline=name == "baseline",
            pod_restart_s=a.pod_restart_s,
            keep_alive_s=a.keep_alive_s,
            keep_alive_attempts=a.keep_alive_attempts,
            **polls,
            mode=a.mode,
        )
        print(f"== {name}", flush=True)
        t = time.monotonic()
        res = run_node_loss(run, out / name)
        if name == "clean":
            clean_hash = res.final_state_sha256
        row = {
            "config": name,
            "status": res.status,
            "emulation": res.mode,
            "nodes": a.nodes,
            "ranks": a.nodes * a.nproc,
            "pod_restart_s": a.pod_restart_s,
            "lost": res.lost_host,
            "recovery_s": res.recovery_s,
            "steps_lost": res.steps_lost,
            "tiers": res.tiers,
            "training_goodput": res.figures.get("training_goodput"),
            "wall_s": res.figures.get("wall_s"),
            "final_state_sha256": res.final_state_sha256,
            "matches_clean": res.final_state_sha256 is not None
            and res.final_state_sha256 == clean_hash,
        }
        rows.append(row)
        print(
            f"   done in {time.monotonic() - t:.1f}s: {row['status']}, recovery {row['recovery_s']}",
            flush=True,
        )
    print()
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    bad = [r["config"] for r in rows if r["status"] != "Complete" or not r["matches_clean"]]
    if bad:
        print(f"\nFAILED: {bad} did not finish with the clean run's state", file=sys.stderr)
        return 1
    return 0
