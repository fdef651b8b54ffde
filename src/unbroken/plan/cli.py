"""``unbroken plan``: predicted goodput of a job under each layering, with the spread.

Flags map one-to-one to ``PlanConfig`` fields (``--restart-s launcher=15``: one entry of a
mapping). ``--from RUN`` starts from a real run's measured figures (``measured``); flags given
next to it override them. ``--recommend`` (with ``--from RUN_DIR``) sizes the durable and
snapshot intervals and the hang timeouts on that run instead (``tune_cli``). ``--validate``
prints the stored validations instead (``scenarios``) and exits 1 when one is outside its
tolerance.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

from unbroken.plan import measured, scenarios, tune_cli
from unbroken.plan.config import KINDS, LAYERINGS, PlanConfig, merge_fields
from unbroken.plan.model import predict
from unbroken.plan.simulate import simulate

# Tolerances (points of goodput) of the validations: the same job at another length; another
# run of the same job (another load, other fault positions); the published run.
TOLERANCE = {"demo": 0.5, "run200": 2.5, "published": 1.0}

_NUMBERS = (
    ("nodes", int),
    ("gpus_per_node", int),
    ("steps", int),
    ("step_time_s", float),
    ("state_bytes", float),
    ("storage_bytes_per_s", float),
    ("stage_bytes_per_s", float),
    ("ckpt_every_steps", int),
    ("memory_every_steps", int),
    ("memory_slots", int),
    ("replica_slots", int),
    ("startup_s", float),
    ("exception_detection_s", float),
    ("hang_timeout_s", float),
    ("heartbeat_timeout_s", float),
    ("collective_timeout_s", float),
    ("process_detection_s", float),
    ("node_detection_s", float),
    ("hot_spares", int),
    ("node_repair_s", float),
)
_MAPPINGS = (
    ("failures_per_gpu_hour", "KIND=RATE", float),
    ("injected", "KIND=N", int),
    ("restart_s", "LAYER=S", float),
    ("restore_s", "TIER=S", float),
    ("steps_lost", "LAYER=N", float),
)


def field_docs() -> dict[str, str]:
    """PlanConfig's one-line field docstrings, by field (the flags' help)."""
    tree = ast.parse(inspect.getsource(PlanConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for node, nxt in zip(body, body[1:], strict=False):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            assert isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            out[node.target.id] = " ".join(str(nxt.value.value).split())
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    docs = field_docs()
    for name, kind in _NUMBERS:
        default = PlanConfig.__dataclass_fields__[name].default
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"{docs.get(name, '')} (default {default})".replace("%", "%%"),
        )
    for name, metavar, _ in _MAPPINGS:
        p.add_argument(
            f"--{name.replace('_', '-')}",
            nargs="+",
            metavar=metavar,
            default=None,
            help=docs.get(name, "").replace("%", "%%"),
        )
    p.add_argument("--llama3", action="store_true", help="Llama 3's interruption rate and causes")
    p.add_argument("--sync-checkpoint", action="store_true", help="durable saves block the step")
    p.add_argument("--no-memory-tier", action="store_true", help="no snapshots in host memory")
    p.add_argument("--from", dest="from_run", metavar="RUN", help="a run dir or report JSON")
    p.add_argument("--layerings", nargs="+", choices=LAYERINGS, default=list(LAYERINGS))
    p.add_argument("--trials", type=int, default=200, help="Monte Carlo trials per layering")
    p.add_argument("--seed", type=int, default=0, help="seed of the Monte Carlo trials")
    p.add_argument("--validate", action="store_true", help="the stored validations, then exit")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON ('-': stdout)")
    tune_cli.add_arguments(p)


def _pairs(name: str, items: list[str], kind: type) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--{name.replace('_', '-')} {item!r}: expected KEY=VALUE")
        try:
            out[key] = kind(value)
        except ValueError:
            raise ValueError(
                f"--{name.replace('_', '-')} {item!r}: {value!r} is not a {kind.__name__}"
            ) from None
    return out


def given_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The PlanConfig fields the flags give (``--llama3``: its rates), nothing else."""
    fields: dict[str, Any] = {}
    if args.llama3:
        fields["failures_per_gpu_hour"] = {
            k: scenarios.LLAMA3_RATE * share for k, share in scenarios.LLAMA3_SHARES.items()
        }
    for name, _ in _NUMBERS:
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    for name, _, kind in _MAPPINGS:
        items = getattr(args, name)
        if items is not None:
            fields[name] = _pairs(name, items, kind)
    if args.sync_checkpoint:
        fields["async_checkpoint"] = False
    if args.no_memory_tier:
        fields["memory_tier"] = False
    return fields


def config_from(args: argparse.Namespace) -> tuple[PlanConfig, list[str]]:
    """The plan's config (and the fields a run measured) from parsed flags."""
    base: dict[str, Any] = {}
    sources: list[str] = []
    if args.from_run:
        m = measured.load(args.from_run)
        base = m.fields
        sources = m.sources
    return PlanConfig(**merge_fields(base, given_fields(args))), sources


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def run_plan(cfg: PlanConfig, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for layering in args.layerings:
        pred = predict(cfg, layering)
        spread = simulate(cfg, layering, trials=args.trials, seed=args.seed)
        rows.append({"prediction": pred.to_dict(), "monte_carlo": spread.to_dict()})
    return {"config": _config_dict(cfg), "layerings": rows, "stop_grace_s": cfg.stop_grace_s}


def _config_dict(cfg: PlanConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in PlanConfig.__dataclass_fields__:
        value = getattr(cfg, name)
        out[name] = dict(value) if hasattr(value, "items") else value
    return out


def print_plan(cfg: PlanConfig, doc: dict[str, Any], sources: list[str]) -> None:
    mode = (
        "injected " + ", ".join(f"{n} {k}" for k, n in cfg.injected.items())
        if cfg.injected
        else ", ".join(f"{k} {cfg.failures_per_gpu_hour.get(k, 0):.2e}" for k in KINDS)
        + " per GPU-hour"
    )
    print(
        f"job: {cfg.nodes} x {cfg.gpus_per_node} GPUs, {cfg.steps} steps of "
        f"{cfg.step_time_s:.3g} s, state {_size(cfg.state_bytes)}, storage "
        f"{_size(cfg.storage_bytes_per_s)}/s; faults: {mode}"
    )
    if sources:
        print(f"measured (--from): {', '.join(sources)}; the rest are defaults")
    print(
        f"graceful preemption: a stop grace of at least {math.ceil(cfg.stop_grace_s)} s "
        "(--ft-stop-grace-s, terminationGracePeriodSeconds): two steps, then one durable save, "
        "doubled"
    )
    head = (
        f"{'layering':<11} {'training goodput':>16} {'p5-p95 (MC)':>13} {'infra':>7} "
        f"{'faults':>7} {'durable every':>13} {'memory every':>12} {'memory/node':>11} "
        f"{'spares':>6}"
    )
    print(head)
    print("-" * len(head))
    for row in doc["layerings"]:
        p, mc = row["prediction"], row["monte_carlo"]
        tg = mc["training_goodput"]
        memory = "-" if p["memory_every_steps"] is None else f"{p['memory_every_steps']} steps"
        print(
            f"{p['layering']:<11} {_pct(p['training_goodput']):>16} "
            f"{_pct(tg['p5']) + '-' + _pct(tg['p95']):>13} {_pct(p['infra_goodput']):>7} "
            f"{p['faults']:>7.1f} {str(p['ckpt_every_steps']) + ' steps':>13} {memory:>12} "
            f"{_size(p['memory_tier_bytes_per_node']):>11} {p['hot_spares']:>6}"
        )


def validate(*, show: bool = True) -> tuple[list[dict[str, Any]], bool]:
    """Every stored validation; ok when each checked one is within its tolerance (the
    published run's infrastructure goodput is shown, not checked: see ``published.json``)."""
    rows: list[dict[str, Any]] = []
    ok = True
    for c in scenarios.checks():
        tol = TOLERANCE[c.scenario.split()[0]]
        checked = not (c.scenario.startswith("published") and c.figure == "infra_goodput")
        within = abs(c.delta_points) <= tol
        ok = ok and (within or not checked)
        rows.append(
            {
                "scenario": c.scenario,
                "layering": c.layering,
                "figure": c.figure,
                "expected": c.expected,
                "predicted": c.predicted,
                "delta_points": c.delta_points,
                "tolerance_points": tol if checked else None,
                "within": within,
            }
        )
    if show:
        print(
            f"{'scenario':<28} {'layering':<11} {'figure':<17} {'measured':>9} {'plan':>7} {'d':>6}"
        )
        for r in rows:
            mark = (
                ""
                if r["within"]
                else "  (not checked)"
                if r["tolerance_points"] is None
                else "  OUTSIDE"
            )
            print(
                f"{r['scenario']:<28} {r['layering']:<11} {r['figure']:<17} "
                f"{_pct(r['expected']):>9} {_pct(r['predicted']):>7} {r['delta_points']:>+6.1f}{mark}"
            )
    return rows, ok


def main(args: argparse.Namespace) -> int:
    if args.recommend:
        return tune_cli.main(args, given_fields(args))
    if args.validate:
        rows, ok = validate(show=args.json != "-")
        doc: dict[str, Any] = {"validation": rows}
        code = 0 if ok else 1
    else:
        cfg, sources = config_from(args)
        doc = run_plan(cfg, args)
        doc["measured"] = sources
        if args.json != "-":
            print_plan(cfg, doc, sources)
        code = 0
    if args.json == "-":
        print(json.dumps(doc, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    sys.stdout.flush()
    return code
