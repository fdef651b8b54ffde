"""``unbroken bench writer``: what the persisting checkpoint writer takes from training steps.

Two ranks of the reference workload under ``unbroken-run`` (durable saves every
``--ckpt-every`` steps, no snapshots), once per writer priority (``--writer-priority`` of the
workload), in one run:

- ``equal``: the writer at its trainer's priority, in its trainer's session;
- ``nice``: a session of its own (its autogroup at niceness 19, where the kernel has
  autogroups) and niceness 10;
- ``idle`` (the default): the same, and SCHED_IDLE.

A save persists while the next step runs, so that step is the one the writer slows. Per
configuration, from rank 0's ledger (steps after the first ``SKIP``): the median step right
after a durable save (``after ms``), the median of the others (``other ms``), their difference
(``cost ms``: what one persist takes from the step it overlaps), the mean step and the median
persist time. On a machine with cores to spare the cost is near 0 whatever the priority; it
shows where training takes every core (as here: 2 ranks on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger import read_events

CONFIGS = ("equal", "nice", "idle")
SKIP = 20
"""Steps left out at the start (warm-up, the first saves)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=300, help="steps per configuration")
    p.add_argument("--ckpt-every", type=int, default=5, help="a durable save every N steps")
    p.add_argument("--model", default="tiny", help="reference model size")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")


def figures(run_dir: Path) -> dict[str, Any]:
    """The figures of one run from rank 0's ledger (see the module docstring)."""
    steps: dict[int, float] = {}
    saved: set[int] = set()
    persist = []
    for e in read_events(run_dir):
        if e.rank != 0:
            continue
        step = e.data.get("step")
        if e.kind == ev.STEP and isinstance(step, int) and step >= SKIP:
            steps[step] = float(e.data["dur_s"])
        elif e.kind == ev.CKPT_STAGE and e.data.get("durable") and isinstance(step, int):
            saved.add(step)
        elif e.kind == ev.CKPT_PERSIST:
            persist.append(float(e.data["dur_s"]))
    after = [d for s, d in steps.items() if s - 1 in saved]
    other = [d for s, d in steps.items() if s - 1 not in saved]
    if not after or not other:
        raise RuntimeError(f"{run_dir}: no step after a durable save to compare (see its log)")
    after_ms, other_ms = 1e3 * statistics.median(after), 1e3 * statistics.median(other)
    return {
        "after_ms": after_ms,
        "other_ms": other_ms,
        "cost_ms": after_ms - other_ms,
        "mean_step_ms": 1e3 * statistics.mean(steps.values()),
        "persist_s": statistics.median(persist) if persist else None,
        "saves": len(after),
    }


def _run(config: str, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "unbroken.launcher.cli", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "0", "--monitor-interval", "0.05", "--ft-run-dir", str(run_dir),
        "-m", "unbroken.workload.train", "--model", args.model, "--steps", str(args.steps),
        "--batch-size", "8", "--seq-len", "64", "--ckpt-every", str(args.ckpt_every),
        "--snapshot-every", "0", "--writer-priority", config, "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = run_dir.with_suffix(".log")
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{config}: the training run exited with {rc}; see {log}")
    return {"config": config, **figures(run_dir)}


def main(args: argparse.Namespace) -> int:
    if args.steps <= SKIP + 2 * args.ckpt_every or args.ckpt_every < 2:
        raise SystemExit(
            f"--steps must exceed {SKIP} + 2 x --ckpt-every and --ckpt-every must be >= 2 "
            f"(got --steps {args.steps}, --ckpt-every {args.ckpt_every})"
        )
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="unbroken-writer-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs:
        print(f"== {config}", flush=True)
        rows.append(_run(config, root / config, args))
    print()
    print(f"{'writer':8} {'after ms':>9} {'other ms':>9} {'cost ms':>8} {'mean ms':>8} persist s")
    for r in rows:
        persist = "–" if r["persist_s"] is None else f"{r['persist_s']:.3f}"
        print(
            f"{r['config']:8} {r['after_ms']:9.1f} {r['other_ms']:9.1f} {r['cost_ms']:+8.1f} "
            f"{r['mean_step_ms']:8.1f} {persist}"
        )
    print(f"\nruns: {root}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
