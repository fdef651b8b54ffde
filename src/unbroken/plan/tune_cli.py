"""``unbroken plan --from RUN --recommend``: intervals and timeouts sized on a run, as text or
JSON (``--json PATH``, ``-`` for stdout).

The other ``plan`` flags size the job the recommendation is for (``--steps``, ``--nodes``,
``--failures-per-gpu-hour``, ``--llama3``, ...) over what the run measured; ``--timeout-factor``,
``--timeout-floor-s`` and ``--snapshot-budget`` are ``TuneConfig``'s fields.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

from unbroken.plan.observed import Durations, Observed, observe
from unbroken.plan.tune import Choice, Job, Recommendation, TuneConfig, job_config, recommend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recommend",
        action="store_true",
        help="with --from RUN_DIR: the durable and snapshot intervals and hang timeouts to "
        "use, sized on that run, with the goodput expected of each, and the environment "
        "that applies them",
    )
    d = TuneConfig()
    p.add_argument(
        "--timeout-factor",
        type=float,
        default=d.timeout_factor,
        help="--recommend: a hang timeout is this many times the longest duration seen "
        "(default %(default)s)",
    )
    p.add_argument(
        "--timeout-floor-s",
        type=float,
        default=d.timeout_floor_s,
        help="--recommend: no hang timeout below this (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-budget",
        type=float,
        default=d.snapshot_budget,
        help="--recommend: snapshots and notes may block at most this fraction of a step "
        "(default %(default)s)",
    )


def main(args: argparse.Namespace, given: dict[str, Any]) -> int:
    """Recommend for ``args.from_run``; ``given``: the PlanConfig fields the flags set."""
    if not args.from_run:
        raise ValueError(
            "--recommend needs --from RUN_DIR: the run directory of a job whose compute and "
            "storage times to size on (e.g. python -m unbroken.workload.train --run-dir D ...)"
        )
    if Path(args.from_run).is_file():
        raise ValueError(
            f"--from {args.from_run}: --recommend reads a run directory (its ledger's phases, "
            "saves and steps), not a report JSON; pass the job's --run-dir"
        )
    tune = TuneConfig(
        timeout_factor=args.timeout_factor,
        timeout_floor_s=args.timeout_floor_s,
        snapshot_budget=args.snapshot_budget,
    )
    obs = observe(args.from_run)
    job = job_config(obs, given)
    rec = recommend(obs, job, tune)
    doc = {
        "observed": obs.to_dict(),
        "job": {
            "layering": job.layering,
            "steps": job.config.steps,
            "gpus": job.config.gpus,
            "step_time_s": job.config.step_time_s,
            "failures_per_gpu_hour": dict(job.config.failures_per_gpu_hour),
            "injected": dict(job.config.injected),
        },
        "recommendation": rec.to_dict(),
    }
    if args.json == "-":
        print(json.dumps(doc, indent=1))
        return 0
    print(format_text(obs, job, rec))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _ms(d: Durations, *, max_too: bool = False) -> str:
    if d.median is None or d.max is None:
        return "-"
    out = f"{d.median * 1e3:.3g} ms"
    if max_too and d.count > 1:
        out += f" (max {d.max * 1e3:.3g})"
    return f"{out} x{d.count}"


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 1:
        return f"{x * 1e3:.3g} ms"
    if x < 600:
        return f"{x:.3g} s"
    return f"{x / 3600:.3g} h" if x < 3 * 86400 else f"{x / 86400:,.0f} days"


def _pct(x: float | None) -> str:
    return "never ends" if x is None else f"{100 * x:.2f}%"


def _measured(obs: Observed) -> list[str]:
    restores = ", ".join(f"{t} {_ms(d)}" for t, d in obs.restore_s.items()) or "none"
    lines = [
        f"run {obs.run}: {obs.steps_completed} steps on {obs.world_size} rank(s), "
        f"{obs.nodes} node(s); a step computes {_ms(obs.step_s, max_too=True)}",
        f"  blocking: durable save {_ms(obs.save_s)}, snapshot {_ms(obs.snapshot_s)}, "
        f"note {_ms(obs.note_s)}",
        f"  storage: persist {_s(obs.persist_s.median)} x{obs.persist_s.count}, durable "
        f"{_s(obs.durable_lag_s.max)} after its save (slowest), {obs.skipped_saves} save(s) "
        f"skipped; restore: {restores}",
    ]
    if obs.faults:
        lines.append(f"  faults: {len(obs.faults)}")
        for f in obs.faults:
            lines.append(
                f"    {f.kind or '?':<12} layer {f.layer or '-':<12} detected {_s(f.detection_s)}"
                f", recovered {_s(f.recovery_s)}, {f.steps_lost if f.steps_lost is not None else '-'}"
                f" step(s) lost, restored from {f.restore_tier or '-'}"
            )
    else:
        lines.append("  faults: none")
    return lines


def _durable_rows(rows: tuple[Choice, ...], chosen: int, step_s: float) -> list[str]:
    out = [
        f"  {'every':>8} {'saves every':>11} {'blocking':>9} {'lost/fault':>10} "
        f"{'goodput, restored from disk':>28} {'with memory tier':>16}"
    ]
    for r in rows:
        mark = "  <-" if r.every == chosen else ""
        out.append(
            f"  {r.every:>8} {r.effective:>11} {_share(r.blocking_s_per_step / step_s):>9} "
            f"{_n(r.lost_steps):>10} {_pct(r.goodput):>28} {_pct(r.goodput_memory_tier):>16}"
            f"{mark}"
        )
    return out


def _why(text: str) -> str:
    return textwrap.fill(
        text + ".", width=100, initial_indent="  why: ", subsequent_indent="       "
    )


def _share(x: float) -> str:
    return f"{100 * x:.2f}%" if x >= 1e-4 else "<0.01%"


def _n(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def format_text(obs: Observed, job: Job, rec: Recommendation) -> str:
    cfg = job.config
    lines = _measured(obs)
    lines += [
        "",
        textwrap.fill(
            f"for a job of {cfg.steps:,} steps on {cfg.gpus} GPU(s), {job.layering} recovery, "
            f"a fault every {_s(rec.mtbf_s)} of training; fault rate: {job.rate_source}",
            width=100,
            subsequent_indent="  ",
        ),
        "",
        f"durable checkpoint: every {rec.ckpt_every} steps",
        *_durable_rows(rec.ckpt_choices, rec.ckpt_every, cfg.step_time_s),
        _why(rec.ckpt_why),
        "",
        f"memory snapshot: every {rec.snapshot_every} step(s)",
        f"  {'every':>8} {'blocking/step':>13} {'of a step':>9} {'lost/fault':>10} {'goodput':>8}",
    ]
    for r in rec.snapshot_choices:
        mark = "  <-" if r.every == rec.snapshot_every else ""
        lines.append(
            f"  {r.every:>8} {_s(r.blocking_s_per_step):>13} "
            f"{_share(r.blocking_s_per_step / cfg.step_time_s):>9} {_n(r.lost_steps):>10} "
            f"{_pct(r.goodput):>8}{mark}"
        )
    lines += [_why(rec.snapshot_why), "", "hang timeouts:"]
    lines.append(f"  {'phase':<14} {'seen':>5} {'longest':>9} {'timeout':>9} {'a hang costs':>12}")
    for t in rec.timeouts:
        lines.append(
            f"  {t.name:<14} {t.count:>5} {_s(t.longest_s):>9} {t.timeout_s:>7g} s "
            f"{_s(t.hang_cost_s):>12}"
        )
    lines += [_why(rec.timeouts_why), "", "apply (the library reads these):", ""]
    lines.append(f"  {rec.env_line()}")
    return "\n".join(lines)
