"""``unbroken bench scale``: the control plane past one machine, as curves over sizes.

Five curves, each measured with the real code and lightweight stand-ins where a training
process is not needed (each module's docstring says exactly what is stood in):

- ``heartbeat`` (``scale_heartbeat``): one launcher agent watching 8 -> 4096 ranks;
- ``rendezvous`` (``scale_rendezvous``): 2 -> 32 agent processes forming and re-forming a round;
- ``commit`` (``scale_commit``): 2 -> 1024 ranks' records merged into a committed checkpoint,
  then ``restore()``'s listing and checks;
- ``report`` (``scale_ledger``): ``unbroken report`` on ranks x steps records, up to 1024 x 10k;
- ``spawn`` (``scale_spawn``): 1 -> 16 workers of one node started from the warm pool's
  standbys and forked from it, against cold starts.

Each metric gets a power-law fit ``y = a * n^b`` on the upper half of its sizes (log-log least
squares), named by its slope (constant, sublinear, linear, n log n, quadratic), and the size at
which it reaches 10 ms, 1% of a 1 s step (what the cost is paid per is in the table: per second
of training, per fault, per checkpoint, per restart, per report). ``--quick`` runs smaller tops
(a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEP_BUDGET_S = 0.01  # 1% of a 1 s step

SIZES = {
    "heartbeat": ([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096], [8, 64, 512, 4096]),
    "rendezvous": ([2, 4, 8, 16, 32], [2, 4, 8]),
    "commit": ([2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], [2, 16, 128, 1024]),
    "report": ([16, 64, 256, 1024], [16, 64, 256]),  # ranks, x 10k steps (--quick: 1000)
    "spawn": ([1, 2, 4, 8, 16], [1, 2, 4, 8]),
}
CURVES = tuple(SIZES)
# (curve, metric, unit, paid per, 1%-of-a-step figure?)
METRICS = (
    ("heartbeat", "agent_cpu_s_per_s", "cpu s/s", "second of training", True),
    ("heartbeat", "overshoot_s", "s", "fault (past the timeout)", True),
    ("rendezvous", "form_s", "s", "job start / restart", True),
    ("rendezvous", "reform_s", "s", "lost node (incl. keep-alive)", True),
    ("commit", "merge_s", "s", "checkpoint (rank 0's writer)", True),
    ("commit", "merge_peak_bytes", "B", "checkpoint", False),
    ("commit", "restore_listing_s", "s", "restart (every rank)", True),
    ("commit", "restore_listing_peak_bytes", "B", "restart", False),
    ("report", "report_s", "s", "report (offline)", True),
    ("report", "report_memory_bytes", "B", "report (offline)", False),
    ("report", "unfolded_report_s", "s", "report, unfolded (before)", True),
    ("report", "unfolded_report_memory_bytes", "B", "report, unfolded (before)", False),
    ("spawn", "standby_spawn_s", "s", "worker restart (the node's workers)", True),
    ("spawn", "warm_spawn_s", "s", "worker restart, no standby (forked then)", True),
    ("spawn", "cold_spawn_s", "s", "worker restart without the warm pool", True),
)
X_NAME = {
    "heartbeat": "ranks",
    "rendezvous": "agents",
    "commit": "ranks",
    "report": "records",
    "spawn": "workers",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller top sizes (a few minutes)")
    p.add_argument("--curves", nargs="+", choices=CURVES, default=list(CURVES))
    p.add_argument("--report-steps", type=int, default=None, help="steps per rank (report)")
    p.add_argument("--json", metavar="PATH", help="write the curves and fits as JSON")


def fit(xs: list[float], ys: list[float]) -> dict[str, Any] | None:
    """``y = a * x^b`` on the upper half of the points (positive ones); None if < 2 points."""
    pts = sorted((x, y) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0)
    if len(pts) >= 4:
        pts = pts[len(pts) // 2 :]
    if len(pts) < 2:
        return None
    lx = [math.log(x) for x, _ in pts]
    ly = [math.log(y) for _, y in pts]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / sxx if sxx else 0.0
    a = math.exp(my - b * mx)
    return {"a": a, "slope": b, "order": order(b), "fitted_on": [x for x, _ in pts]}


def order(slope: float) -> str:
    if slope < 0.2:
        return "constant"
    if slope < 0.8:
        return f"sublinear (n^{slope:.2f})"
    if slope < 1.15:
        return "linear"
    if slope < 1.5:
        return "n log n"
    if slope < 2.5:
        return "quadratic"
    return f"n^{slope:.1f}"


def size_at(xs: list[float], ys: list[float], f: dict[str, Any] | None, budget: float) -> Any:
    """The size at which the cost reaches ``budget``: interpolated (log-log) between the two
    measured sizes that straddle it, else extrapolated with the fit past the largest; "<n"
    when even the smallest size n costs more; None when it does not grow."""
    pts = sorted(zip(xs, ys, strict=True))
    if pts and pts[0][1] >= budget:
        return f"<{pts[0][0]:.0f}"
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if y0 < budget <= y1 and y0 > 0:
            w = math.log(budget / y0) / math.log(y1 / y0)
            return float(math.exp(math.log(x0) + w * math.log(x1 / x0)))
    if f is None or f["slope"] < 0.05:
        return None
    return float((budget / f["a"]) ** (1 / f["slope"]))


def _run_curve(name: str, sizes: list[int], steps: int) -> list[dict[str, Any]]:
    from unbroken.bench import (
        scale_commit,
        scale_heartbeat,
        scale_ledger,
        scale_rendezvous,
        scale_spawn,
    )

    measure: dict[str, Callable[[int], dict[str, Any]]] = {
        "heartbeat": scale_heartbeat.measure,
        "rendezvous": scale_rendezvous.measure,
        "commit": scale_commit.measure,
        "report": lambda n: scale_ledger.measure(n, steps),
        "spawn": scale_spawn.measure,
    }
    rows = []
    for n in sizes:
        t = time.perf_counter()
        row = measure[name](n)
        row["bench_s"] = time.perf_counter() - t
        print(f"  {name} {n}: {_brief(name, row)}", flush=True)
        rows.append(row)
    return rows


def _brief(name: str, row: dict[str, Any]) -> str:
    keys = [m for c, m, *_ in METRICS if c == name and m in row]
    return ", ".join(f"{k}={_fmt(row[k], 'B' if k.endswith('bytes') else 's')}" for k in keys)


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "B":
        for u, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
            if abs(v) >= s:
                return f"{v / s:.1f} {u}"
        return f"{v:.0f} B"
    return f"{v:.4g}"


def _n(v: Any) -> str:
    if v is None:
        return "never"
    if isinstance(v, str):
        return v
    return f"{v:.3g}" if v < 1e9 else "> 1e9"


def summarize(curves: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for curve, metric, unit, per, budget in METRICS:
        rows = curves.get(curve)
        if not rows:
            continue
        rows = [r for r in rows if metric in r]
        if not rows:
            continue
        xs = [float(r[X_NAME[curve]]) for r in rows]
        ys = [float(r[metric]) for r in rows]
        f = fit(xs, ys)
        item: dict[str, Any] = {
            "curve": curve,
            "metric": metric,
            "unit": unit,
            "per": per,
            "sizes": xs,
            "values": ys,
            "fit": f,
            "size_at_1pct_of_1s_step": size_at(xs, ys, f, STEP_BUDGET_S) if budget else None,
        }
        if curve == "report" and f is not None:
            top = 1024 * 10_000 * 1.02  # 1024 ranks x 10k steps (+ checkpoint records)
            item["at_1024_ranks_x_10k_steps"] = f["a"] * top ** f["slope"]
        out.append(item)
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    head = (
        f"{'curve':<10} {'metric':<27} {'smallest':>10} {'largest':>10} {'at size':>9} "
        f"{'slope':>6} {'growth':<20} {'10 ms at n':>10}  paid per"
    )
    print(head)
    print("-" * (len(head) + 20))
    for s in summary:
        f = s["fit"]
        print(
            f"{s['curve']:<10} {s['metric']:<27} {_fmt(s['values'][0], s['unit']):>10} "
            f"{_fmt(s['values'][-1], s['unit']):>10} {s['sizes'][-1]:>9.0f} "
            f"{'-' if f is None else format(f['slope'], '.2f'):>6} "
            f"{'-' if f is None else f['order']:<20} "
            f"{_n(s['size_at_1pct_of_1s_step']) if s['unit'] != 'B' else '':>10}  {s['per']}"
        )
    for s in summary:
        if "at_1024_ranks_x_10k_steps" in s:
            print(
                f"report at 1024 ranks x 10k steps (10.2M records, extrapolated): {s['metric']} "
                f"= {_fmt(s['at_1024_ranks_x_10k_steps'], s['unit'])}"
            )


def main(args: argparse.Namespace) -> int:
    steps = args.report_steps or (1000 if args.quick else 10_000)
    curves: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name in args.curves:
        full, quick = SIZES[name]
        sizes = quick if args.quick else full
        print(
            f"== {name}: {X_NAME[name]} {sizes}" + (f" x {steps} steps" if name == "report" else "")
        )
        curves[name] = _run_curve(name, sizes, steps)
    summary = summarize(curves)
    print()
    print_table(summary)
    end_load = os.getloadavg()
    print(
        f"\n{time.perf_counter() - t0:.0f} s; load average at end: {end_load[0]:.2f} "
        f"{end_load[1]:.2f} {end_load[2]:.2f} (figures under load; CPU time is steadier)"
    )
    if args.json:
        doc = {
            "quick": args.quick,
            "load_average": {"start": load, "end": end_load},
            "curves": curves,
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
