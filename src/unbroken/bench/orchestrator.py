"""Kubernetes' part in the benchmarks, on the one emulated cluster (``unbroken.k8s.emulate``).

Labelled an emulation everywhere it is reported (ledger records carry ``emulated``).

- ``baseline_objects``: what Kubernetes alone runs (Kubeflow Trainer v2's layout): a JobSet
  whose replicated Job has one pod per node; each pod runs the training as ranks of a static
  world (one rank per pod: the command itself, ``RANK`` = the completion index; more: torchrun
  with the static rendezvous), rank 0's pod serving the store at
  ``<name>-node-0-0.<name>:29500``. No recovery inside the job: a failed pod fails the child
  Job (``backoffLimit: 0``), the JobSet deletes every pod and recreates them
  (``failurePolicy.maxRestarts``); they start after the pod start delay and resume from the
  last checkpoint. A hung rank ends when its peers' collective timeout fails them.
- ``run_orchestrated``: that baseline for ``cfg.nproc`` one-rank pods, recorded in the run's
  ledger (rank -1, layer "orchestrator"): ``fault_detected`` at the first failed pod of a
  launch (detector "pod-exit"), ``restart_begin``/``restart_end`` around each JobSet restart,
  ``worker_exit`` per pod, ``job_end``.
- ``run_node``: a job with its own recovery (``unbroken-run``) as the one pod of an Indexed
  Job. When a ``node-loss`` fault took the node (the pod died and a node-loss claim is newer
  than it), the pod has ``DisruptionTarget`` and is replaced after the Job controller's back-off
  (``restart_delay_s``, doubled per replacement), at most ``max_restarts`` times
  (``backoffLimitPerIndex``); any other failure is final (``FailIndex``): the launcher
  recovers everything else itself. Recorded (only when a node is lost) as ``fault_detected``
  (cause "node-loss", detector "orchestrator"), ``restart_begin``, ``restart_end``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken import env as envnames
from unbroken.faults import fired_faults
from unbroken.k8s.emulate import Cluster, EmulationConfig
from unbroken.k8s.emulate.workloads import RESTART_ANNOTATION
from unbroken.ledger import Ledger
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)

STORE_PORT = 29500
REPLICATED_JOB = "node"


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """The emulated orchestrator's timings."""

    nproc: int = 2
    """Ranks (one-rank pods) of the baseline job."""
    restart_delay_s: float = 2.0
    """Baseline: from a JobSet restart to its pods' start. run_node: the Job controller's
    back-off before the first replacement (doubled for each further one)."""
    max_restarts: int = 10
    """Baseline: JobSet restarts (``maxRestarts``); run_node: replacements of a lost node."""
    job_timeout_s: float = 600.0
    """Safety net: the whole emulated job is killed after this long."""
    mode: str = "auto"
    """Emulation mode: "netns" (root), "loopback", or "auto"."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if self.restart_delay_s < 0:
            raise ValueError(f"restart_delay_s must be >= 0, got {self.restart_delay_s}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.job_timeout_s > 0:
            raise ValueError(f"job_timeout_s must be > 0, got {self.job_timeout_s}")


@dataclass
class OrchestratorResult:
    """How the emulated job ended."""

    returncode: int
    """0 when the job completed; else the last failed pod's exit code (128 + N: signal N)."""
    launches: int
    """Launches of the job (baseline) or of the node's pod (run_node)."""
    output: str
    """Combined output of every pod, in start order."""


def baseline_objects(
    *,
    name: str,
    nodes: int,
    nproc: int,
    command: Sequence[str],
    max_restarts: int,
    claim: str | None = None,
    mount: str | None = None,
    env: dict[str, str] | None = None,
    working_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Kubernetes alone: a headless-DNS JobSet of ``nodes`` pods × ``nproc`` ranks (see above)."""
    master = f"{name}-{REPLICATED_JOB}-0-0.{name}"
    index = "$(JOB_COMPLETION_INDEX)"
    container_env = [
        {
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        },
        {
            "name": "RESTART_ATTEMPT",
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{RESTART_ANNOTATION}']"}
            },
        },
        {"name": envnames.OMP_NUM_THREADS, "value": "1"},
        {"name": envnames.UNBROKEN_RUN_ID, "value": name},
        *({"name": k, "value": v} for k, v in sorted((env or {}).items())),
    ]
    if nproc == 1:
        argv = list(command)
        container_env += [
            {"name": envnames.RANK, "value": index},
            {"name": envnames.GROUP_RANK, "value": index},
            {"name": envnames.LOCAL_RANK, "value": "0"},
            {"name": envnames.WORLD_SIZE, "value": str(nodes)},
            {"name": envnames.LOCAL_WORLD_SIZE, "value": "1"},
            {"name": envnames.MASTER_ADDR, "value": master},
            {"name": envnames.MASTER_PORT, "value": str(STORE_PORT)},
            {"name": envnames.RESTART_COUNT, "value": "$(RESTART_ATTEMPT)"},
        ]
    else:
        argv = [
            "torchrun",
            f"--nnodes={nodes}",
            f"--nproc-per-node={nproc}",
            f"--node-rank={index}",
            "--rdzv-backend=static",
            f"--master-addr={master}",
            f"--master-port={STORE_PORT}",
            "--max-restarts=0",
            *command,
        ]
    container: dict[str, Any] = {
        "name": "trainer",
        "image": "emulated",
        "command": argv[:1],
        "args": argv[1:],
        "env": container_env,
        "ports": [{"name": "store", "containerPort": STORE_PORT}],
    }
    if working_dir is not None:
        container["workingDir"] = working_dir
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if claim is not None and mount is not None:
        container["volumeMounts"] = [{"name": "checkpoints", "mountPath": mount}]
        pod["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}}]
    job = {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": 0,
        "template": {"spec": pod},
    }
    return [
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                "failurePolicy": {"maxRestarts": max_restarts},
                "replicatedJobs": [
                    {"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}
                ],
            },
        }
    ]


def _drive(
    cluster: Cluster, cfg: OrchestratorConfig, on_line: Callable[[str], None] | None
) -> tuple[str, str]:
    """Wait for the job (passing new pod log lines to ``on_line``); (status, all output)."""
    deadline = time.monotonic() + cfg.job_timeout_s
    read: dict[Path, int] = {}

    def pump() -> None:
        for pod in list(cluster.pods):
            if pod.log is None or not pod.log.exists():
                continue
            data = pod.log.read_bytes()
            end = data.rfind(b"\n") + 1
            start, read[pod.log] = read.get(pod.log, 0), max(end, read.get(pod.log, 0))
            if on_line is not None:
                for line in data[start:end].decode(errors="replace").splitlines(keepends=True):
                    on_line(line)

    try:
        while True:
            pump()
            if all(w.settled for w in cluster.workloads):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"emulated job exceeded {cfg.job_timeout_s}s")
            time.sleep(0.05)
        pump()
        status = str(cluster.status())
    finally:
        cluster.close()
    output = "".join(
        p.log.read_text(errors="replace") for p in cluster.pods if p.log and p.log.exists()
    )
    return status, output


def run_orchestrated(
    cmd: Sequence[str],
    *,
    run_dir: Path,
    cfg: OrchestratorConfig,
    run_id: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> OrchestratorResult:
    """Run ``cmd`` as ``cfg.nproc`` one-rank pods of the Kubernetes-only baseline, each with
    ``env`` (default: this process's) under the pod's own, in ``cwd`` (default: ours)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = run_id or run_dir.name
    cluster = Cluster(
        run_dir / "orchestrator",
        cfg=EmulationConfig(mode=cfg.mode, pod_start_delay_s=cfg.restart_delay_s),
        env=dict(os.environ if env is None else env),
    )
    docs = baseline_objects(
        name="job",
        nodes=cfg.nproc,
        nproc=1,
        command=cmd,
        max_restarts=cfg.max_restarts,
        working_dir=None if cwd is None else str(cwd),
    )
    cluster.apply(docs)
    status, output = _drive(cluster, cfg, None)
    launches, code = _record_baseline(cluster.history, run_dir, run_id, delay_s=cfg.restart_delay_s)
    return OrchestratorResult(0 if status == "Complete" else code or 1, launches, output)


def _record_baseline(
    history: list[dict[str, Any]], run_dir: Path, run_id: str, *, delay_s: float
) -> tuple[int, int]:
    """The baseline's ledger records from the cluster's history; (launches, last failure code)."""
    ledger = Ledger(run_dir, run=run_id, rank=ev.LAUNCHER_RANK)
    launch, detected, restarting, code = 0, False, False, 0
    try:
        for h in history:
            kind, ts = h["event"], h["ts"]
            if kind == "pod_started" and restarting:
                launch, restarting, detected = launch + 1, False, False
                ledger.set_context(attempt=launch)
                ledger.emit(ev.RESTART_END, ts=ts, layer="orchestrator", emulated=True)
            elif kind == "pod_failed" and not detected:
                detected, code = True, int(h["exit_code"])
                ledger.emit(
                    ev.FAULT_DETECTED,
                    ts=ts,
                    cause=_cause(code),
                    detector="pod-exit",
                    layer="orchestrator",
                    fault_rank=h["index"],
                    exit_code=code,
                    emulated=True,
                )
            elif kind == "pod_ended" and h.get("index") is not None:
                ledger.emit(ev.WORKER_EXIT, ts=ts, worker_rank=h["index"], exit_code=h["exit_code"])
            elif kind == "jobset_restart":
                restarting = True
                ledger.emit(
                    ev.RESTART_BEGIN, ts=ts, layer="orchestrator", delay_s=delay_s, emulated=True
                )
            elif kind in ("jobset_complete", "jobset_failed"):
                status = "ok" if kind == "jobset_complete" else "failed"
                ledger.emit(ev.JOB_END, ts=ts, status=status, launches=launch + 1, emulated=True)
    finally:
        ledger.close()
    return launch + 1, code


def node_job(
    cmd: Sequence[str], *, max_restarts: int, working_dir: str | None = None
) -> list[dict[str, Any]]:
    """One node's launcher as the one pod of an Indexed Job (see ``run_node``)."""
    container: dict[str, Any] = {"name": "launcher", "image": "emulated", "command": list(cmd)}
    if working_dir is not None:
        container["workingDir"] = working_dir
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "node", "namespace": "default"},
            "spec": {
                "completionMode": "Indexed",
                "completions": 1,
                "parallelism": 1,
                "backoffLimitPerIndex": max_restarts,
                "podReplacementPolicy": "Failed",
                "podFailurePolicy": {
                    "rules": [
                        {
                            "action": "Count",
                            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                        },
                        {
                            "action": "FailIndex",
                            "onExitCodes": {"operator": "NotIn", "values": [0]},
                        },
                    ]
                },
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [container],
                    }
                },
            },
        }
    ]


def run_node(
    cmd: Sequence[str],
    *,
    run_dir: Path,
    cfg: OrchestratorConfig,
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    run_id: str | None = None,
    cwd: Path | None = None,
) -> OrchestratorResult:
    """Run one node's launcher (``cmd``, writing its faults under ``run_dir``) as Kubernetes runs
    the node's pod (see the module docstring); ``cfg.nproc`` is not used."""
    run_id = run_id or run_dir.name
    run_dir.mkdir(parents=True, exist_ok=True)

    def disrupted(pod: Any) -> bool:  # a node-loss claim newer than the pod: its node is gone
        return any(
            r.get("kind") == "node-loss" and float(r.get("ts", 0)) >= pod.started
            for r in fired_faults(run_dir)
        )

    cluster = Cluster(
        run_dir / "orchestrator",
        cfg=EmulationConfig(mode=cfg.mode, failure_backoff_s=cfg.restart_delay_s),
        env=dict(os.environ if env is None else env),
        disrupted=disrupted,
    )
    cluster.apply(
        node_job(cmd, max_restarts=cfg.max_restarts, working_dir=None if cwd is None else str(cwd))
    )
    status, output = _drive(cluster, cfg, on_line)
    pods = [p for p in cluster.pods if p.proc is not None]
    code = 0 if status == "Complete" else (pods[-1].exit_code if pods else 1) or 1
    ledger: Ledger | None = None
    claims = sorted(
        (r for r in fired_faults(run_dir) if r.get("kind") == "node-loss"), key=lambda r: r["ts"]
    )
    launch = 0
    try:
        for h in cluster.history:
            if h["event"] == "pod_failed" and "DisruptionTarget" in h["conditions"]:
                claim = claims[launch] if launch < len(claims) else {}
                if ledger is None:
                    ledger = Ledger(run_dir, run=run_id, rank=ev.LAUNCHER_RANK, attempt=launch)
                ledger.emit(
                    ev.FAULT_DETECTED,
                    ts=h["ts"],
                    cause="node-loss",
                    detector="orchestrator",
                    layer="orchestrator",
                    fault_rank=claim.get("rank"),
                    exit_code=h["exit_code"],
                    emulated=True,
                )
                if launch < cfg.max_restarts:
                    delay = cfg.restart_delay_s * 2**launch
                    ledger.emit(
                        ev.RESTART_BEGIN,
                        ts=h["ts"],
                        layer="orchestrator",
                        delay_s=delay,
                        emulated=True,
                    )
            elif h["event"] == "pod_started" and ledger is not None and h["pod"] != pods[0].name:
                launch += 1
                ledger.set_context(attempt=launch)
                ledger.emit(ev.RESTART_END, ts=h["ts"], layer="orchestrator", emulated=True)
            elif h["event"] == "job_failed" and ledger is not None:
                ledger.emit(
                    ev.JOB_END, ts=h["ts"], status="failed", launches=len(pods), emulated=True
                )
    finally:
        if ledger is not None:
            ledger.close()
    logger.info("node pod launched %d times: %s", len(pods), status)
    return OrchestratorResult(code, len(pods), output)


def _cause(code: int) -> str:
    if code > 128:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            return f"signal {code - 128}"
    return f"exit {code}"


def train_command(args: Sequence[str]) -> list[str]:
    """The reference script as a plain process: no launcher and no in-process restart (the
    baseline has no in-job recovery; a fault ends the process)."""
    return [sys.executable, "-m", "unbroken.workload.train", "--no-inprocess", *args]
