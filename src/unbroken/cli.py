"""The ``unbroken`` umbrella CLI: reports, the dashboard, the knowledge base, fault plans,
benchmarks, Kubernetes manifests, the goodput planner, the environment doctor."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unbroken import __version__
from unbroken.log import init_logging

logger = logging.getLogger(__name__)


def _cmd_report(args: argparse.Namespace) -> int:
    from unbroken.ledger import goodput, read_run, report
    from unbroken.ledger.html import RunView, render

    views = []
    for run_dir in args.run_dirs:
        # Other ranks' steps folded (the same figures, a fraction of the memory), unless the
        # HTML report draws them.
        result = read_run(run_dir, fold_steps_except=None if args.html else args.reference_rank)
        if not result.events and not (result.digest and result.digest.count):
            print(f"error: the ledger in {run_dir} has no records", file=sys.stderr)
            return 2
        rep = goodput.compute(
            result.events, reference_rank=args.reference_rank, digest=result.digest
        )
        views.append(RunView(Path(run_dir).name, rep, result.events))
        if args.json:
            text = report.to_json(rep)
            if args.json == "-":
                print(text)
            elif len(args.run_dirs) == 1:
                Path(args.json).write_text(text + "\n")
        if args.json != "-":
            if len(args.run_dirs) > 1:
                print(f"== {run_dir}")
            print(report.format_table(rep))
            if result.torn_lines or result.bad_lines:
                print(
                    f"\nnote: skipped {result.torn_lines} torn last line(s) and "
                    f"{len(result.bad_lines)} unparsable line(s) in {result.files} ledger files"
                )
    if args.json and args.json != "-" and len(args.run_dirs) > 1:
        Path(args.json).write_text(report.to_json_many([v.report for v in views]) + "\n")
    if args.html:
        Path(args.html).write_text(render(views))
        if args.json != "-":
            print(f"\nHTML report: {Path(args.html).resolve()}")
    return 0


def _kinds() -> list[str]:
    from unbroken.faults import KINDS

    return list(KINDS)


def _when(f: Any) -> str:
    """When a fault fires, as ``faults show`` prints it ("after step 12", "phase data ...")."""
    return f"after step {f.step:>5}" if f.phase is None else f.when()


def _cmd_faults_show(args: argparse.Namespace) -> int:
    from unbroken.faults import KINDS, load_plan

    plan = load_plan(args.plan, world_size=args.world_size)
    if args.world_size is not None:
        plan.check_world(args.world_size)
    if not len(plan):
        print(f"{args.plan}: no faults")
        return 0
    print(f"{args.plan}: {len(plan)} fault(s), in firing order")
    width = max(len(f.kind) for f in plan.faults)
    when = max(len(_when(f)) for f in plan.faults)
    for f in plan.faults:
        settings = f.settings()
        shown = ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
        print(f"  {_when(f):<{when}} on rank {f.rank:>3}: {f.kind:<{width}} {KINDS[f.kind]}")
        if shown:
            print(f"  {'':<{when}} {'':>11} {'':<{width}} ({shown})")
    return 0


def _cmd_faults_kinds(args: argparse.Namespace) -> int:
    import textwrap

    from unbroken.faults import KINDS
    from unbroken.faults.plan import NON_DISRUPTIVE, PARAMS

    for kind, what in KINDS.items():
        tag = " (non-disruptive: nothing restarts)" if kind in NON_DISRUPTIVE else ""
        print(f"{kind}{tag}")
        print(textwrap.fill(what, width=96, initial_indent="    ", subsequent_indent="    "))
        for name, (default, takes) in PARAMS.get(kind, {}).items():
            print(f"    {name}: {takes}; default {default}")
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from unbroken.dashboard import app

    return app.main(args)


def _cmd_kb(args: argparse.Namespace) -> int:
    from unbroken.kb import KnowledgeBase, text

    if args.kb_command == "ingest":
        failed = 0
        with KnowledgeBase(args.db) as kb:
            for run_dir in args.run_dirs:
                try:
                    rec = kb.ingest(run_dir)
                except (FileNotFoundError, ValueError) as e:
                    print(f"error: {e}", file=sys.stderr)
                    failed += 1
                    continue
                print(f"ingested {rec.name}: {rec.status}, {len(rec.faults)} fault(s) -> {kb.path}")
        return 2 if failed else 0
    with KnowledgeBase(args.db, create=False) as kb:
        if args.kb_command == "search":
            hits = kb.search(" ".join(args.query), limit=args.limit)
            if not hits:
                print(f"no run matches {' '.join(args.query)!r} in {kb.path}")
            for h in hits:
                goodput = "-" if h.training_goodput is None else f"{h.training_goodput * 100:.1f}%"
                print(f"{h.id:>4}  {h.name}  {h.status}  goodput {goodput}  faults {h.faults}")
                print(f"      {h.path}")
                print(f"      {' '.join(h.snippet.split())}")
        elif args.kb_command == "show":
            print(text.show(kb.get(args.run)), end="")
        else:
            print(text.compare(kb.get(args.runs[0]), kb.get(args.runs[1])), end="")
    return 0


# name -> (module under unbroken.bench, help); each module has add_arguments(p) and main(args).
BENCHES: dict[str, tuple[str, str]] = {
    "ledger": ("ledger", "cost of a ledger record on the training thread"),
    "recovery": ("recovery", "the published recovery comparison, every layer side by side"),
    "checkpoint": ("checkpoint", "checkpoint stall and efficiency: none, DCP sync/async, ours"),
    "size": ("size", "checkpoint and restore at gigabytes per rank, against the machine's limits"),
    "writer": ("writer", "what the persisting writer takes from the steps, per its priority"),
    "restart": ("restart", "launcher restart: SIGKILL/SIGSTOP -> training again, vs torchrun"),
    "dashboard": ("dashboard", "what watching a job costs: refresh on a long run, step time"),
    "inprocess": ("inprocess", "in-process restart: exception, stuck collective, Python hang"),
    "k8s": ("k8s", "node loss on the emulated Kubernetes cluster: hot spare, replacement, alone"),
    "scale": ("scale", "control-plane scaling curves: heartbeats, rendezvous, commit, report"),
}


def _bench_module(name: str) -> Any:
    return importlib.import_module(f"unbroken.bench.{BENCHES[name][0]}")


def _cmd_bench(args: argparse.Namespace) -> int:
    return int(_bench_module(args.bench).main(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unbroken", description=__doc__)
    p.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("report", help="goodput figures of run directories")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="the --run-dir of a job")
    r.add_argument("--json", metavar="PATH", help="also write the figures as JSON ('-': stdout)")
    r.add_argument("--html", metavar="OUT", help="also write a self-contained HTML report")
    r.add_argument("--reference-rank", type=int, default=0, help="rank whose steps are timed")
    r.set_defaults(func=_cmd_report)

    f = sub.add_parser("faults", help="fault plans")
    fsub = f.add_subparsers(dest="faults_command", required=True)
    fs = fsub.add_parser(
        "show",
        help="print a plan's schedule as it will fire",
        description="Print a fault plan's schedule as it will fire. A plan is YAML: a list "
        "'faults' of {step, rank, kind} entries (extra keys: the kind's parameters), or with "
        "'phase' (init, recovery, restore, save, persist, shutdown, or a phase the script "
        "names: data, validation, ...) to fire on entry into that phase, after 'step' or at "
        "its 'occurrence'-th entry; and/or a seeded 'random' schedule. Kinds: "
        + ", ".join(sorted(_kinds())),
    )
    fs.add_argument("plan", help="a fault plan (YAML)")
    fs.add_argument("--world-size", type=int, default=None, help="check ranks against a world")
    fs.set_defaults(func=_cmd_faults_show)
    fk = fsub.add_parser("kinds", help="every fault kind: what it does, its parameters")
    fk.set_defaults(func=_cmd_faults_kinds)

    from unbroken.dashboard.app import add_arguments as dashboard_arguments

    d = sub.add_parser("dashboard", help="a live web view of runs, with /metrics and alerts")
    dashboard_arguments(d)
    d.set_defaults(func=_cmd_dashboard)

    k = sub.add_parser("kb", help="the searchable record of runs (SQLite FTS5)")
    k.add_argument(
        "--db", default=None, help="the database (default: $UNBROKEN_KB or runs/kb.sqlite)"
    )
    ksub = k.add_subparsers(dest="kb_command", required=True)
    ki = ksub.add_parser("ingest", help="index run directories (again: replaces them)")
    ki.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ks = ksub.add_parser("search", help="runs matching words or an FTS5 query")
    ks.add_argument("query", nargs="+", metavar="QUERY")
    ks.add_argument("--limit", type=int, default=20)
    ksh = ksub.add_parser("show", help="one run: results, configuration, faults")
    ksh.add_argument("run", metavar="RUN", help="an id, a path or a name")
    kc = ksub.add_parser("compare", help="two runs side by side")
    kc.add_argument("runs", nargs=2, metavar="RUN")
    k.set_defaults(func=_cmd_kb)
    from unbroken.k8s import cli as k8s_cli

    k8 = sub.add_parser("k8s", help="Kubernetes: render and validate manifests, the store pod")
    k8s_cli.add_arguments(k8)
    k8.set_defaults(func=k8s_cli.main)

    from unbroken.plan import cli as plan_cli

    pl = sub.add_parser("plan", help="predicted goodput per layering, checkpoint interval, spares")
    plan_cli.add_arguments(pl)
    pl.set_defaults(func=plan_cli.main)

    from unbroken import doctor

    dr = sub.add_parser(
        "doctor",
        help="check this machine before a job runs on it, and say what to fix",
        description="Check this machine before a job runs on it: torch and its backends, "
        "memory against the staging the job needs, /dev/shm, the checkpoint file system, "
        "cgroups, network namespaces, ports, clocks. One line per check: ok, warn, FAIL or "
        "skip, what was found and what to do.",
        epilog="Exit codes: 0 nothing failed (warnings allowed), "
        f"{doctor.EXIT_FAILED} a check failed, 2 bad input.",
    )
    doctor.add_arguments(dr)
    dr.set_defaults(func=doctor.main)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, (_, help_text) in BENCHES.items():
        _bench_module(name).add_arguments(bsub.add_parser(name, help=help_text))
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    init_logging()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, LookupError, OSError) as e:  # bad input, a path that cannot be used
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
