"""How each configuration of ``unbroken bench recovery`` runs its target (``recovery``).

``CONFIGS`` names them; ``run_config`` runs one into a run directory: as one-rank pods of the
emulated Kubernetes-only baseline (``orchestrator.run_orchestrated``) or under ``unbroken-run``
as the one pod of an Indexed Job (``orchestrator.run_node``), with the configuration given to
the target through the environment only (``target.configuration_env``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from unbroken.bench.orchestrator import OrchestratorConfig, run_node, run_orchestrated
from unbroken.bench.recovery_table import NO_FAULTS
from unbroken.bench.target import (
    NEEDS_ADOPTION,
    REFERENCE_MODULE,
    Target,
    configuration_env,
)
from unbroken.faults import load_plan
from unbroken.launcher.config import DEFAULT_PRELOAD


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What every configuration trains when the target is the reference script."""

    model: str = "tiny"
    """Reference model size."""
    steps: int = 200
    """Training steps."""
    batch_size: int = 8
    """Samples per rank per step."""
    seq_len: int = 64
    """Tokens per sample."""
    nproc: int = 2
    """Ranks."""
    ckpt_every: int = 25
    """Steps between checkpoints (0: none)."""
    pg_timeout_s: float = 10.0
    """Collective timeout of the workers (what the baseline's survivors wait out)."""

    def args(self) -> list[str]:
        """The reference script's flags (the configuration's own, and the run directory,
        come by environment)."""
        out = [
            "--model",
            self.model,
            "--steps",
            str(self.steps),
            "--batch-size",
            str(self.batch_size),
            "--seq-len",
            str(self.seq_len),
            "--pg-timeout-s",
            str(self.pg_timeout_s),
            "--log-every",
            str(max(1, self.steps // 10)),
        ]
        if self.ckpt_every:
            out += ["--ckpt-every", str(self.ckpt_every)]
        return out


@dataclass(frozen=True, kw_only=True)
class Config:
    """One configuration of the comparison."""

    label: str
    """What it is, in the table's words."""
    pods: bool
    """Run as one-rank pods of the Kubernetes-only baseline (else under unbroken-run)."""
    inprocess: bool = False
    """In-process restart on (``UNBROKEN_INPROCESS``)."""
    ckpt_mode: str | None = None
    """``UNBROKEN_CKPT_MODE`` (None: "async", or ``--ckpt-mode`` for the baseline)."""
    faulted: bool = True
    """The fault plan is given (else a fault-free reference)."""

    def needs_adoption(self) -> str | None:
        """Why a plain script cannot run this configuration (None: it can)."""
        if self.inprocess:
            return NEEDS_ADOPTION["inprocess"]
        if self.ckpt_mode == "sync":
            return NEEDS_ADOPTION["sync"]
        return None


CONFIGS: dict[str, Config] = {
    "clean": Config(label="no faults", pods=True, faulted=False),
    "inprocess": Config(
        label="in-process restart, launcher behind it, async ckpt", pods=False, inprocess=True
    ),
    "inprocess-sync": Config(
        label="in-process restart, launcher behind it, sync ckpt",
        pods=False,
        inprocess=True,
        ckpt_mode="sync",
    ),
    "launcher": Config(label="unbroken-run restarts only, async ckpt", pods=False),
    # Fault-free twins: the same runs without the plan, the references of the gaps.
    "inprocess" + NO_FAULTS: Config(
        label="the inprocess configuration, no faults", pods=False, inprocess=True, faulted=False
    ),
    "launcher" + NO_FAULTS: Config(
        label="the launcher configuration, no faults", pods=False, faulted=False
    ),
    "launcher-sync": Config(
        label="unbroken-run restarts only, sync ckpt", pods=False, ckpt_mode="sync"
    ),
    "baseline": Config(label="orchestrator only (emulated Kubernetes restart)", pods=True),
}


def run_config(
    cfg: Config,
    *,
    target: Target,
    w: Workload,
    run_dir: Path,
    plan: Path | None,
    a: argparse.Namespace,
) -> tuple[int, str]:
    """One configuration's run into ``run_dir``: (exit code, output)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    work = run_dir / "work"  # the command's working directory: no run sees another's files
    work.mkdir(exist_ok=True)
    snapshot_every = a.snapshot_every
    if snapshot_every is None and target.reference:
        snapshot_every = 1
    env = configuration_env(
        run_dir=run_dir,
        plan=plan,
        inprocess=cfg.inprocess,
        ckpt_mode=cfg.ckpt_mode or (a.ckpt_mode if cfg.pods else "async"),
        memory_tier=not cfg.pods,  # Kubernetes alone keeps nothing in memory
        snapshot_every=snapshot_every,
        soft_timeout_s=a.hang_timeout_s,
        # The plan's faults are injected, not a flaky rank: in-process restart keeps them
        # (the hand-over to the launcher has its own tests).
        max_rank_faults=plan_size(plan) + 1 if plan is not None else None,
        pg_timeout_s=a.pg_timeout_s,
    )
    if cfg.pods:
        ocfg = OrchestratorConfig(
            nproc=w.nproc,
            restart_delay_s=a.pod_restart_s if cfg.faulted else 0.0,
            max_restarts=a.max_restarts if cfg.faulted else 0,
            job_timeout_s=a.job_timeout_s,
        )
        res = run_orchestrated(target.python_argv(), run_dir=run_dir, cfg=ocfg, env=env, cwd=work)
        return res.returncode, res.output
    preload = list(DEFAULT_PRELOAD)
    if target.reference:  # a restarted worker starts training at once instead of importing
        preload.append(REFERENCE_MODULE)
    cmd = [
        sys.executable,
        "-m",
        "unbroken.launcher.cli",
        "--standalone",
        "--nproc-per-node",
        str(w.nproc),
        "--max-restarts",
        str(a.max_restarts),
        "--monitor-interval",
        "0.05",
        "--ft-run-dir",
        str(run_dir),
        # A node-loss relaunches this command (a replaced pod): it continues the same run.
        "--ft-resume",
        # The launcher's hang timeout sits above in-process restart's hard timeout.
        "--ft-steady-timeout-s",
        str(a.hang_timeout_s * (4 if cfg.inprocess else 1)),
        "--ft-heartbeat-interval-s",
        str(min(0.5, a.hang_timeout_s / 5)),
        "--ft-preload",
        ",".join(preload),
        *target.launcher_argv(),
    ]
    shown = ""

    def progress(line: str) -> None:  # while it runs: steps, faults, restarts
        nonlocal shown
        if _PROGRESS.search(line):
            msg = line.rstrip().split("] ", 1)[-1][:110]  # drop the logging prefix
            if msg != shown:  # every rank logs a restart: show it once
                print(f"   {line[11:19]} {msg}", flush=True)
                shown = msg

    # Kubernetes' part: relaunch the node's launcher when a node-loss took it.
    node = OrchestratorConfig(
        nproc=1,
        restart_delay_s=a.pod_restart_s,
        max_restarts=a.max_restarts,
        job_timeout_s=a.job_timeout_s,
    )
    res = run_node(cmd, run_dir=run_dir, cfg=node, env=env, on_line=progress, cwd=work)
    return res.returncode, res.output


def plan_size(plan: Path | None) -> int:
    """How many faults the plan fires (any world size: 0 without a plan)."""
    if plan is None:
        return 0
    return len(load_plan(plan, world_size=1 << 16).faults)


_PROGRESS = re.compile(r"step \d+ loss|injecting fault|restarting \(|in-process restart|giving up")
