"""``unbroken bench recovery``: the published recovery comparison, reproduced in one command.

The same workload and the same fault plan under each configuration; every figure comes from
the same ledger code (``unbroken.ledger.goodput``). Configurations:

- ``clean``: no faults (the reference hash and step time);
- ``baseline``: Kubernetes alone on the emulated cluster (``unbroken.k8s.emulate``; an
  emulation, so labelled): one-rank pods of a JobSet; a failed pod fails the job, the JobSet
  recreates every pod after the pod-restart delay (a hung rank ends by its peers' collective
  timeout);
- ``inprocess`` / ``launcher`` (with ``-sync`` variants): registered by the layers that provide
  them (``RUNNERS``), when present. They run ``unbroken-run`` as the one pod of an Indexed Job
  on the same emulated cluster (``run_node``), which replaces it, after the same pod-restart
  delay, only when a ``node-loss`` fault took the whole node;
- ``inprocess-nofault`` / ``launcher-nofault``: those two without the plan, the fault-free
  twins their goodput gap is taken against (``recovery_table``).

Correctness column: a configuration that recovers must end with the clean run's
``final_state_sha256``. A faulted run's gap to its fault-free reference (its twin, else clean)
is in points of training goodput; what it is made of: ``faults`` (what they cost: the ledger's
``fault_s``, restarted processes' start-up included) and ``ckpt`` (saves', snapshots' and
notes' blocking: the price of being ready), shares of the wall time, beside the median step
(where background work shows).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.bench.fault_classes import format_fault_classes
from unbroken.bench.orchestrator import (
    OrchestratorConfig,
    run_node,
    run_orchestrated,
    train_command,
)
from unbroken.bench.recovery_table import (
    NO_FAULTS,
    ConfigResult,
    format_summary,
    format_table,
    pct,
    set_gaps,
)
from unbroken.faults import load_plan, parse_plan
from unbroken.launcher.config import DEFAULT_PRELOAD
from unbroken.ledger import goodput, read_events
from unbroken.ledger.html import RunView, render

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What every configuration trains."""

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
    snapshot_every: int = 1
    """Steps between memory-only snapshots in the unbroken configurations (0: none)."""
    pg_timeout_s: float = 10.0
    """Collective timeout of the workers (what the baseline's survivors wait out)."""

    def args(
        self, run_dir: Path, *, plan: Path | None, ckpt_mode: str, snapshots: bool = False
    ) -> list[str]:
        out = [
            "--model",
            self.model,
            "--steps",
            str(self.steps),
            "--batch-size",
            str(self.batch_size),
            "--seq-len",
            str(self.seq_len),
            "--run-dir",
            str(run_dir),
            "--pg-timeout-s",
            str(self.pg_timeout_s),
            "--log-every",
            str(max(1, self.steps // 10)),
        ]
        if self.ckpt_every:
            out += ["--ckpt-every", str(self.ckpt_every), "--ckpt-mode", ckpt_mode]
        if snapshots and self.snapshot_every:
            out += ["--snapshot-every", str(self.snapshot_every)]
        if plan is not None:
            out += ["--faults", str(plan)]
        return out


# A runner trains the workload once into run_dir and returns (returncode, output).
Runner = Callable[[Workload, Path, "Path | None", argparse.Namespace], tuple[int, str]]


def _run_clean(
    w: Workload, run_dir: Path, plan: Path | None, a: argparse.Namespace
) -> tuple[int, str]:
    cfg = OrchestratorConfig(
        nproc=w.nproc, restart_delay_s=0.0, max_restarts=0, job_timeout_s=a.job_timeout_s
    )
    res = run_orchestrated(
        train_command(w.args(run_dir, plan=None, ckpt_mode="async")), run_dir=run_dir, cfg=cfg
    )
    return res.returncode, res.output


def _run_baseline(
    w: Workload, run_dir: Path, plan: Path | None, a: argparse.Namespace
) -> tuple[int, str]:
    cfg = OrchestratorConfig(
        nproc=w.nproc,
        restart_delay_s=a.pod_restart_s,
        max_restarts=a.max_restarts,
        job_timeout_s=a.job_timeout_s,
    )
    res = run_orchestrated(
        train_command(w.args(run_dir, plan=plan, ckpt_mode=a.ckpt_mode)),
        run_dir=run_dir,
        cfg=cfg,
    )
    return res.returncode, res.output


def _run_unbroken(
    w: Workload,
    run_dir: Path,
    plan: Path | None,
    a: argparse.Namespace,
    *,
    inprocess: bool,
    ckpt_mode: str,
) -> tuple[int, str]:
    """The job under ``unbroken-run``: with in-process restart (every layer) or without it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    script = w.args(run_dir, plan=plan, ckpt_mode=ckpt_mode, snapshots=True)
    if inprocess:
        script += [
            "--soft-timeout-s",
            str(a.hang_timeout_s),
            "--hard-timeout-s",
            str(a.hang_timeout_s * 3),
            # The plan's faults are injected, not a flaky rank: in-process restart keeps them
            # (the hand-over to the launcher has its own tests).
            "--max-rank-faults",
            str(_plan_size(plan) + 1),
        ]
    else:
        script.append("--no-inprocess")
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
        str(a.hang_timeout_s * (4 if inprocess else 1)),
        "--ft-heartbeat-interval-s",
        str(min(0.5, a.hang_timeout_s / 5)),
        # The warm pool imports the training script's modules too: a restarted worker starts
        # training at once instead of importing (0.1 s idle, 0.25 s on busy cores).
        "--ft-preload",
        ",".join((*DEFAULT_PRELOAD, "unbroken.workload.train")),
        "-m",
        "unbroken.workload.train",
        *script,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
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
    res = run_node(cmd, run_dir=run_dir, cfg=node, env=env, on_line=progress)
    return res.returncode, res.output


def _plan_size(plan: Path | None) -> int:
    """How many faults the plan fires (any world size: 0 without a plan)."""
    if plan is None:
        return 0
    return len(load_plan(plan, world_size=1 << 16).faults)


_PROGRESS = re.compile(r"step \d+ loss|injecting fault|restarting \(|in-process restart|giving up")


def _unbroken(*, inprocess: bool, mode: str) -> Runner:
    """A runner under unbroken-run: every layer (``inprocess``) or the launcher alone."""
    return functools.partial(_run_unbroken, inprocess=inprocess, ckpt_mode=mode)


RUNNERS: dict[str, tuple[str, Runner]] = {
    "clean": ("no faults", _run_clean),
    "inprocess": (
        "in-process restart, launcher behind it, async ckpt",
        _unbroken(inprocess=True, mode="async"),
    ),
    "inprocess-sync": (
        "in-process restart, launcher behind it, sync ckpt",
        _unbroken(inprocess=True, mode="sync"),
    ),
    "launcher": (
        "unbroken-run restarts only, async ckpt",
        _unbroken(inprocess=False, mode="async"),
    ),
    # Fault-free twins: the same runs without the plan, the references of the gaps.
    "inprocess" + NO_FAULTS: (
        "the inprocess configuration, no faults",
        _unbroken(inprocess=True, mode="async"),
    ),
    "launcher" + NO_FAULTS: (
        "the launcher configuration, no faults",
        _unbroken(inprocess=False, mode="async"),
    ),
    "launcher-sync": (
        "unbroken-run restarts only, sync ckpt",
        _unbroken(inprocess=False, mode="sync"),
    ),
    "baseline": ("orchestrator only (emulated Kubernetes restart)", _run_baseline),
}


def default_plan(steps: int, count: int, seed: int, kinds: list[str]) -> dict[str, Any]:
    """The published schedule scaled down: ``count`` faults, seeded, over the middle of the run."""
    lo, hi = max(1, steps // 10), max(2, steps * 9 // 10)
    return {"random": {"count": count, "kinds": kinds, "seed": seed, "steps": [lo, hi]}}


def run_bench(a: argparse.Namespace) -> list[ConfigResult]:
    """Run every requested configuration; returns their results (clean first)."""
    import yaml

    out_dir = Path(a.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    w = Workload(
        model=a.model,
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        nproc=a.nproc,
        ckpt_every=a.ckpt_every,
        snapshot_every=a.snapshot_every,
        pg_timeout_s=a.pg_timeout_s,
    )
    plan = out_dir / "plan.yaml"
    if a.plan:
        spec = yaml.safe_load(Path(a.plan).read_text())
    else:
        spec = default_plan(a.steps, a.faults, a.seed, a.kinds)
    # Every configuration gets the same explicit schedule, expanded once for this world.
    expanded = parse_plan(spec, source=str(a.plan or "seeded schedule"), world_size=a.nproc)
    plan.write_text(
        yaml.safe_dump(
            {
                "faults": [
                    {"step": f.step, "rank": f.rank, "kind": f.kind, **dict(f.params)}
                    for f in expanded.faults
                ]
            },
            default_flow_style=None,
        )
    )
    print(f"fault plan ({plan}):")
    for f in expanded.faults:
        print(f"  {f.describe()}")
    configs = ["clean", *[c for c in a.configs if c != "clean"]]
    unknown = [c for c in configs if c not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; available: {sorted(RUNNERS)}")
    results: list[ConfigResult] = []
    clean_hash = None
    # Round-robin: every configuration once, then again (clean, the reference, runs once).
    rounds = [("clean", 1)] + [
        (c, k) for k in range(1, a.repeat + 1) for c in configs if c != "clean"
    ]
    for name, k in rounds:
        label, runner = RUNNERS[name]
        res = ConfigResult(name, label, 0, run=k)
        run_dir = out_dir / res.name
        print(f"== {res.name}: {label}", flush=True)
        t = time.monotonic()
        faulted = name != "clean" and not name.endswith(NO_FAULTS)
        code, output = runner(w, run_dir, plan if faulted else None, a)
        (out_dir / f"{res.name}.log").write_text(output)
        res.returncode = code
        final = run_dir / "final.json"
        if final.exists():
            res.final_state_sha256 = json.loads(final.read_text())["final_state_sha256"]
        if name == "clean":
            clean_hash = res.final_state_sha256
        res.matches_clean = res.final_state_sha256 is not None and res.final_state_sha256 == (
            clean_hash
        )
        try:
            events = read_events(run_dir)
            report = goodput.compute(events)
            res.figures, res.view = report.to_dict(), RunView(res.name, report, events)
        except (FileNotFoundError, ValueError) as e:
            logger.error("%s: no figures: %s", res.name, e)
        print(
            f"   done in {time.monotonic() - t:.1f}s, exit {code}, "
            f"goodput {pct(res.figures.get('training_goodput'))}",
            flush=True,
        )
        results.append(res)
    set_gaps(results)
    return results


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--configs",
        nargs="+",
        default=sorted(RUNNERS),
        help="configurations to run (clean always runs first)",
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--ckpt-mode", choices=["async", "sync"], default="async")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=1,
        help="memory-only snapshots every N steps in the unbroken configurations (0: none; the "
        "clean and baseline runs never snapshot)",
    )
    p.add_argument("--faults", type=int, default=5, help="faults in the seeded schedule")
    p.add_argument("--kinds", nargs="+", default=["exception", "sigkill", "hang"])
    p.add_argument("--seed", type=int, default=42, help="seed of the fault schedule")
    p.add_argument("--plan", default=None, help="a fault plan instead of the seeded schedule")
    p.add_argument("--pg-timeout-s", type=float, default=10.0)
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=2.0,
        help="no step for this long is a hang (in-process soft / launcher timeout)",
    )
    p.add_argument(
        "--pod-restart-s",
        type=float,
        default=4.0,
        help="baseline pod restart delay (published 270 s, scaled to the workload)",
    )
    p.add_argument(
        "--repeat",
        type=_at_least_one,
        default=1,
        metavar="N",
        help="run every configuration but clean N times, round-robin, and give each figure's "
        "median and range (goals are judged on the median: runs differ by more than a point)",
    )
    p.add_argument("--max-restarts", type=int, default=20)
    p.add_argument("--job-timeout-s", type=float, default=900.0)
    p.add_argument("--out", default="runs/bench-recovery", help="output directory")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument(
        "--kb",
        metavar="DB",
        default=None,
        help="knowledge base that ingests every run (default: $UNBROKEN_KB or runs/kb.sqlite)",
    )
    p.add_argument(
        "--html", metavar="PATH", help="write the HTML report (default: OUT/report.html)"
    )


def _ingest(a: argparse.Namespace, results: list[ConfigResult]) -> None:
    """Every configuration's run into the knowledge base (a failure is reported, not fatal)."""
    from unbroken.kb import KnowledgeBase

    try:
        with KnowledgeBase(a.kb) as kb:
            for r in results:
                try:
                    kb.ingest(Path(a.out) / r.name)
                except (FileNotFoundError, ValueError) as e:
                    logger.warning("knowledge base: %s not ingested: %s", r.name, e)
            print(f"\nknowledge base: {len(results)} run(s) ingested into {kb.path}")
    except (OSError, ValueError, RuntimeError) as e:
        logger.warning("knowledge base: not updated: %s", e)


def main(a: argparse.Namespace) -> int:
    results = run_bench(a)
    print()
    print(format_table(results))
    if classes := format_fault_classes(results):
        print(f"\n{classes}")
    summary = format_summary(results)
    if summary:
        print(f"\nover {a.repeat} runs each:\n{summary}")
    rows = [r.row() for r in results]
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    _ingest(a, results)
    html_path = Path(a.html or Path(a.out) / "report.html")
    views = [r.view for r in results if r.view is not None]
    if views:
        html_path.write_text(render(views, title="unbroken recovery benchmark"))
        print(f"\nHTML report: {html_path.resolve()}")
    bad = [r.name for r in results if r.returncode != 0 or not r.matches_clean]
    if bad:
        print(f"\nFAILED: {bad} did not finish with the clean run's state", file=sys.stderr)
        return 1
    return 0
