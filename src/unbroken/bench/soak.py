"""The soak's figures: ``python -m unbroken.bench.soak RUN_DIR ...`` (run by ``scripts/soak.sh``).

Reads the faulty run's report (``unbroken report --json``, written by the script as
``report.json``) and prints, as a table and as ``soak.json``: the faults planned and fired by
kind, the recoveries per layer, steps lost, training and infrastructure goodput, whether the
final state is bit-exact with the fault-free run, and what was left behind. Exits 1 when the
states differ, a planned fault did not fire, or something leaked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from unbroken.faults import load_plan


def figures(run_dir: Path, *, clean_sha: str, faulty_sha: str) -> dict[str, Any]:
    """The soak's figures from ``run_dir`` (plan.yaml, report.json)."""
    plan = load_plan(run_dir / "plan.yaml", world_size=2)
    report = json.loads((run_dir / "report.json").read_text())
    if isinstance(report, list):
        report = report[0]
    faults = report["faults"]
    injected = [f for f in faults if f.get("injected")]
    lost = [f["steps_lost"] for f in faults if f.get("steps_lost") is not None]
    return {
        "faults_planned": len(plan.faults),
        "planned_by_kind": dict(Counter(f.kind for f in plan.faults)),
        "faults_fired": len(injected),
        "fired_by_kind": dict(Counter(str(f["kind"]) for f in injected)),
        "recoveries_by_layer": dict(Counter(str(f["layer"]) for f in faults)),
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
        "training_goodput": report["training_goodput"],
        "infra_goodput": report["infra_goodput"],
        "wall_s": report["wall_s"],
        "launcher_attempts": report["num_attempts"],
        "recovery_s_median": report["recovery_s_median"],
        "recovery_s_max": report["recovery_s_max"],
        "final_state_sha256": faulty_sha,
        "bit_exact": bool(clean_sha) and clean_sha == faulty_sha,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unbroken.bench.soak", description=__doc__)
    p.add_argument("run_dir", type=Path, help="the soak's directory (plan.yaml, report.json)")
    p.add_argument("--clean-sha", required=True, help="final_state_sha256 without faults")
    p.add_argument("--faulty-sha", required=True, help="final_state_sha256 with the plan")
    p.add_argument("--wall-s", type=float, required=True, help="the faulty job's wall time")
    p.add_argument("--clean-wall-s", type=float, required=True, help="the clean job's")
    p.add_argument("--leaks", default="", help="NAME=COUNT ... left behind (0: none)")
    p.add_argument("--agent-fds", default="", help="the agent's descriptor counts")
    args = p.parse_args(argv)
    out = figures(args.run_dir, clean_sha=args.clean_sha, faulty_sha=args.faulty_sha)
    leaks = dict(kv.split("=", 1) for kv in args.leaks.split())
    out["leaks"] = {k: int(v) for k, v in leaks.items()}
    out["agent_fds"] = args.agent_fds
    out["job_wall_s"] = args.wall_s
    out["clean_job_wall_s"] = args.clean_wall_s
    (args.run_dir / "soak.json").write_text(json.dumps(out, indent=2, sort_keys=True))
    for key in sorted(out):
        print(f"{key:22s} {out[key]}")
    ok = (
        out["bit_exact"]
        and out["faults_fired"] == out["faults_planned"]
        and not any(v > 0 for v in out["leaks"].values())
    )
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
