"""``unbroken bench recovery``: the published recovery comparison, reproduced in one command,
on the reference script or on any training script (``-- COMMAND``: the shadow benchmark of a
user's own job).

The same target and the same fault plan under each configuration (``bench.target``: what a
configuration changes reaches the script through the environment, never by editing it); every
figure comes from the same ledger code (``unbroken.ledger.goodput``). Configurations
(``CONFIGS``):

- ``clean``: no faults (the reference hash, loss curve and step time);
- ``baseline``: Kubernetes alone on the emulated cluster (``unbroken.k8s.emulate``; an
  emulation, so labelled): one-rank pods of a JobSet, no in-process restart, no memory tier; a
  failed pod fails the job, the JobSet recreates every pod after the pod-restart delay (a hung
  rank ends by its peers' collective timeout);
- ``inprocess`` / ``launcher`` (with ``-sync`` variants: synchronous checkpoints): under
  ``unbroken-run`` as the one pod of an Indexed Job on the same emulated cluster
  (``run_node``), which replaces it, after the same pod-restart delay, only when a
  ``node-loss`` fault took the whole node;
- ``inprocess-nofault`` / ``launcher-nofault``: those two without the plan, the fault-free
  twins their goodput gap is taken against (``recovery_table``).

A plain torchrun script (it never calls ``unbroken.run``) runs under the observer
(``unbroken.observe``) and skips the configurations that need adoption, saying why.

Correctness column (``judge``): a faulted run must end with the fault-free runs' final hash
where they agree (the script is deterministic); where they do not, its loss curve must stay in
their spread. A user's command without another fault-free configuration runs ``clean`` twice
to tell. A faulted run's gap to its fault-free reference (its twin, else clean) is in points of
training goodput; what it is made of: ``faults`` (what they cost: the ledger's ``fault_s``,
restarted processes' start-up included) and ``ckpt`` (saves', snapshots' and notes' blocking:
the price of being ready), shares of the wall time, beside the median step (where background
work shows).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from unbroken.bench.fault_classes import format_fault_classes
from unbroken.bench.judge import judge, ledger_digest, losses, references_agree
from unbroken.bench.recovery_configs import CONFIGS, Workload, run_config
from unbroken.bench.recovery_table import (
    ConfigResult,
    format_summary,
    format_table,
    pct,
    set_gaps,
)
from unbroken.bench.target import (
    REFERENCE_MODULE,
    Target,
    adopted,
)
from unbroken.faults import parse_plan
from unbroken.ledger import goodput, read_events
from unbroken.ledger.html import RunView, render

logger = logging.getLogger(__name__)

_REFERENCE_FLAGS = ("model", "steps", "batch_size", "seq_len", "ckpt_every")
"""The reference script's workload flags (None unless given)."""


_HASH = re.compile(r"final_state_sha256=([0-9a-f]{64})")


def default_plan(steps: int, count: int, seed: int, kinds: list[str]) -> dict[str, Any]:
    """The published schedule scaled down: ``count`` faults, seeded, over the middle of the run."""
    lo, hi = max(1, steps // 10), max(2, steps * 9 // 10)
    return {"random": {"count": count, "kinds": kinds, "seed": seed, "steps": [lo, hi]}}


def _target(a: argparse.Namespace, w: Workload) -> Target:
    """The reference script with the workload's flags, or the command after ``--`` (the
    workload flags are refused then: the command carries its own)."""
    if not a.command:
        return Target(argv=("-m", REFERENCE_MODULE, *w.args()), reference=True)
    given = [f"--{k.replace('_', '-')}" for k in _REFERENCE_FLAGS if getattr(a, k) is not None]
    target = Target.user(a.command)
    if given and not target.reference:
        raise ValueError(
            f"{', '.join(given)} set(s) the reference script's workload; a command after -- "
            "takes its own arguments instead: drop them (or put them after the command)"
        )
    return target


def _schedule(a: argparse.Namespace, configs: list[str], target: Target) -> list[tuple[str, int]]:
    """Every run, in order: clean first (twice for a user's command when no other fault-free
    run would tell whether it is deterministic), then every other configuration, round-robin
    over ``--repeat`` rounds."""
    others = [c for c in configs if c != "clean"]
    references = 1 + sum(1 for c in others if not CONFIGS[c].faulted) * a.repeat
    cleans = [("clean", 1)] + ([("clean", 2)] if references < 2 and not target.reference else [])
    return cleans + [(c, k) for k in range(1, a.repeat + 1) for c in others]


def _write_plan(a: argparse.Namespace, out_dir: Path, steps: int) -> Path:
    """The one explicit schedule every configuration gets, expanded once for this world."""
    import yaml

    if a.plan:
        spec = yaml.safe_load(Path(a.plan).read_text())
    else:
        spec = default_plan(steps, a.faults, a.seed, a.kinds)
    expanded = parse_plan(spec, source=str(a.plan or "seeded schedule"), world_size=a.nproc)
    plan = out_dir / "plan.yaml"
    plan.write_text(
        yaml.safe_dump({"faults": [f.to_entry() for f in expanded.faults]}, sort_keys=False)
    )
    print(f"fault plan ({plan}):")
    for f in expanded.faults:
        print(f"  {f.describe()}")
    return plan


def run_bench(a: argparse.Namespace) -> list[ConfigResult]:
    """Run every requested configuration; returns their results (clean first)."""
    out_dir = Path(a.out).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {a.out} is a file, not a directory: pass another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    if removed := clear_earlier_run(out_dir):
        print(f"removed an earlier run's {', '.join(removed)} from {out_dir}", flush=True)
    w = Workload(
        model=a.model or "tiny",
        steps=a.steps if a.steps is not None else 200,
        batch_size=a.batch_size or 8,
        seq_len=a.seq_len or 64,
        nproc=a.nproc,
        ckpt_every=a.ckpt_every if a.ckpt_every is not None else 25,
        pg_timeout_s=a.pg_timeout_s,
    )
    target = _target(a, w)
    configs = ["clean", *[c for c in a.configs if c != "clean"]]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; available: {sorted(CONFIGS)}")
    if not target.reference and not target.source_mentions_unbroken():
        target = target.plain()
    print(f"target: {target.name}", flush=True)
    results: list[ConfigResult] = []
    plan: Path | None = None
    skipped: dict[str, str] = {}
    for name, k in _schedule(a, configs, target):
        cfg = CONFIGS[name]
        if target.observed and cfg.needs_adoption():
            skipped.setdefault(name, cfg.needs_adoption() or "")
            continue
        if cfg.faulted and plan is None:
            plan = _write_plan(a, out_dir, _steps_of(results) or w.steps)
        res = ConfigResult(name, cfg.label, 0, run=k)
        print(f"== {res.name}: {cfg.label}", flush=True)
        t = time.monotonic()
        run_dir = out_dir / res.name
        code, output = run_config(
            cfg, target=target, w=w, run_dir=run_dir, plan=plan if cfg.faulted else None, a=a
        )
        if name == "clean" and k == 1 and not target.reference:
            seen = adopted(run_dir)
            if seen is False or (seen is None and not target.observed):
                # Not adopted after all: run it again as the plain script it is.
                target = target.plain()
                print(f"   {target.argv[0]} does not call unbroken.run: run as a plain script")
                shutil.rmtree(run_dir)
                code, output = run_config(cfg, target=target, w=w, run_dir=run_dir, plan=None, a=a)
        (out_dir / f"{res.name}.log").write_text(output)
        res.returncode = code
        res.final_state_sha256 = _final_hash(run_dir, output)
        try:
            events = read_events(run_dir)
            res.final_digest = ledger_digest(events)
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
        if name == "clean" and code != 0:
            raise RuntimeError(
                f"the fault-free run failed (exit {code}): nothing to compare with; its output "
                f"is in {out_dir / f'{res.name}.log'}"
            )
    for name, why in skipped.items():
        print(f"not run: {name}: {why}")
    _judge(results, out_dir)
    set_gaps(results)
    return results


def clear_earlier_run(out_dir: Path) -> list[str]:
    """Remove from ``out_dir`` what an earlier benchmark wrote there: each configuration's run
    directory (one holding a ledger, ``events/``; a run adds its records to the ledger it
    finds, so two runs would read as one), its log, the plan and the HTML report. Anything else
    is left where it is.

    Returns:
        The names removed.
    """
    runs = re.compile(rf"({'|'.join(map(re.escape, CONFIGS))})(\.run\d+)?")
    removed = []
    for entry in sorted(out_dir.iterdir()):
        name = entry.name.removesuffix(".log") if entry.is_file() else entry.name
        if entry.is_dir() and runs.fullmatch(name) and (entry / "events").is_dir():
            shutil.rmtree(entry)
        elif entry.is_file() and (
            entry.name in ("plan.yaml", "report.html")
            or (entry.name.endswith(".log") and runs.fullmatch(name))
        ):
            entry.unlink()
        else:
            continue
        removed.append(entry.name)
    return removed


def _steps_of(results: list[ConfigResult]) -> int | None:
    """Steps the first fault-free run completed (where a user's command places its faults)."""
    for r in results:
        if r.config == "clean" and r.figures.get("steps_completed"):
            return int(r.figures["steps_completed"])
    return None


def _final_hash(run_dir: Path, output: str) -> str | None:
    """The run's ``final_state_sha256``: its ``final.json`` (the reference script's), else the
    last one it printed."""
    final = run_dir / "final.json"
    if final.exists():
        return str(json.loads(final.read_text())["final_state_sha256"])
    found = _HASH.findall(output)
    return found[-1] if found else None


def _judge(results: list[ConfigResult], out_dir: Path) -> None:
    """Each run against the fault-free runs (``judge``); says how they were judged. The hash
    compared is the one the script prints where the fault-free runs printed one, else the
    digest its Checkpointers recorded (``UNBROKEN_FINAL_DIGEST``)."""
    refs = [r for r in results if not CONFIGS[r.config].faulted]
    if not any(r.final_state_sha256 for r in refs):
        for r in results:
            r.final_state_sha256, r.hash_source = r.final_digest, "digest"
    ref_hashes = [r.final_state_sha256 for r in refs]
    agree = references_agree(ref_hashes)
    curves = [losses(out_dir / r.name) for r in refs]
    if agree is False:
        distinct = len({h for h in ref_hashes if h})
        print(
            f"\nNOT DETERMINISTIC: the {len(refs)} fault-free runs ended with {distinct} "
            "different final hashes, so a hash says nothing about a recovery; every run is "
            "judged by its loss curve against the fault-free runs' spread instead"
        )
    elif agree:
        print(f"\ndeterministic: the {len(refs)} fault-free runs ended with the same hash")
    for r in results:
        verdict = judge(
            r.final_state_sha256,
            losses(out_dir / r.name),
            reference_hashes=ref_hashes,
            reference_curves=curves,
        )
        r.verdict = verdict.text()
        r.judged_by = verdict.by
        r.loss_within = verdict.within
        r.matches_clean = verdict.ok


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
        default=sorted(CONFIGS),
        help="configurations to run (clean always runs first)",
    )
    p.add_argument("--model", default=None, help="reference script: model size (tiny)")
    p.add_argument("--steps", type=int, default=None, help="reference script: steps (200)")
    p.add_argument("--batch-size", type=int, default=None, help="reference script: per rank (8)")
    p.add_argument("--seq-len", type=int, default=None, help="reference script: tokens (64)")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        help="reference script: steps between durable checkpoints (25; 0: none)",
    )
    p.add_argument(
        "--ckpt-mode",
        choices=["async", "sync"],
        default="async",
        help="the baseline's checkpoint mode",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=None,
        help="memory-only snapshots every N steps in the unbroken configurations "
        "(UNBROKEN_SNAPSHOT_EVERY; 0: none; default: 1 for the reference script, the "
        "script's own for a command; the clean and baseline runs keep no memory tier)",
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
    p.add_argument(
        "--out",
        default="runs/bench-recovery",
        help="output directory (an earlier benchmark's runs, logs, plan and report there are "
        "removed first; anything else is left)",
    )
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
    p.add_argument(
        "command",
        nargs="*",
        metavar="-- COMMAND",
        help="a training script (SCRIPT.py [ARGS] or -m MODULE [ARGS]) to benchmark instead "
        "of the reference script, after --; one that calls unbroken.run gets every "
        "configuration, a plain torchrun script those that apply to it",
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
    try:
        results = run_bench(a)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
    bad = [r.name for r in results if r.returncode != 0 or r.matches_clean is False]
    if bad:
        print(
            f"\nFAILED: {bad} did not finish, or ended away from the fault-free runs "
            "(their hash, or their loss curve's spread)",
            file=sys.stderr,
        )
        return 1
    return 0
