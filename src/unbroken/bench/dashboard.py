"""``unbroken bench dashboard``: what watching a job costs, side by side in one run.

1. Refresh cost on a long run: a synthetic ledger of ``--long-steps`` steps on 2 ranks (with a
   save every 50 steps and a fault every 5000), written as a job writes it (one file per
   process). Timed: ``unbroken report``'s work (read every file, compute); the dashboard's first
   load; one refresh after a step arrived (tail the appended bytes, recompute, alerts,
   snapshot); an idle refresh of a running job (nothing new: snapshot only); one /metrics render.
2. Step time with and without the dashboard: the reference job (``--steps`` steps, 2 ranks,
   under ``unbroken-run``) alternately alone and watched (``unbroken dashboard`` on its run
   directory, a viewer holding the live stream and a scraper reading /metrics every second),
   ``--trials`` times each; the median step time of each run, from its ledger.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from unbroken.dashboard.metrics import registry_for
from unbroken.dashboard.runs import BUDGET_FACTOR, RunSet
from unbroken.ledger import events as ev
from unbroken.ledger import goodput, read_events, read_run
from unbroken.ledger.events import Event


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long-steps", type=int, default=100_000, help="steps of the synthetic run")
    p.add_argument("--steps", type=int, default=150, help="steps of each real job")
    p.add_argument("--trials", type=int, default=2, help="real jobs per configuration")
    p.add_argument("--skip-job", action="store_true", help="only the refresh cost")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--dir", default=None, help="directory to work in (default: a temp dir)")


def _write_long_run(run_dir: Path, steps: int) -> int:
    """A long run's ledger, as two ranks and a launcher write it; returns the record count."""
    rng = random.Random(0)
    files = {r: open(run_dir / "events" / f"h-p{100 + r}.jsonl", "w") for r in (-1, 0, 1)}  # noqa: SIM115
    n = 0

    def put(e: Event) -> None:
        nonlocal n
        files[e.rank].write(e.to_json() + "\n")
        n += 1

    t = 1_700_000_000.0
    put(Event(kind=ev.PROCESS_START, ts=t, run="long", rank=-1, data={"max_restarts": 100}))
    for rank in (0, 1):
        put(Event(kind=ev.PROCESS_START, ts=t, run="long", rank=rank, data={"world_size": 2}))
    step = executed = 0
    while step < steps:
        dur = 0.2 + rng.random() * 0.01
        t += dur
        for rank in (0, 1):
            put(
                Event(
                    kind=ev.STEP,
                    ts=t,
                    run="long",
                    rank=rank,
                    data={"step": step, "dur_s": dur, "loss": 1.0},
                )
            )
        if step % 50 == 49:
            put(
                Event(
                    kind=ev.CKPT_STAGE,
                    ts=t + 0.01,
                    run="long",
                    data={"step": step, "dur_s": 0.01, "bytes": 1 << 20, "staging_bytes": 1 << 21},
                )
            )
            put(
                Event(
                    kind=ev.CKPT_PERSIST,
                    ts=t + 0.3,
                    run="long",
                    data={"step": step, "dur_s": 0.28, "writer_rss_bytes": 1 << 28},
                )
            )
            put(Event(kind=ev.CKPT_COMMIT, ts=t + 0.31, run="long", data={"step": step}))
            t += 0.01
        executed += 1
        if executed % 5000 == 0:  # a fault every 5000 executed steps
            put(
                Event(
                    kind=ev.FAULT_INJECTED,
                    ts=t,
                    run="long",
                    rank=1,
                    data={"fault": "exception", "step": step},
                )
            )
            put(
                Event(
                    kind=ev.FAULT_DETECTED,
                    ts=t + 0.05,
                    run="long",
                    rank=1,
                    data={"cause": "exception", "detector": "exception", "layer": "inprocess"},
                )
            )
            put(
                Event(
                    kind=ev.RESTART_BEGIN,
                    ts=t + 0.05,
                    run="long",
                    rank=1,
                    data={"layer": "inprocess", "cause": "exception"},
                )
            )
            t += 0.5
            put(
                Event(
                    kind=ev.CKPT_LOAD,
                    ts=t,
                    run="long",
                    data={"step": step - 10, "tier": "memory", "dur_s": 0.05},
                )
            )
            step -= 10  # rolled back to the last save
        step += 1
    for f in files.values():
        f.close()
    return n


def _time(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def refresh_cost(root: Path, steps: int) -> dict[str, Any]:
    run_dir = root / "long"
    (run_dir / "events").mkdir(parents=True)
    n = _write_long_run(run_dir, steps)
    size = sum(p.stat().st_size for p in (run_dir / "events").glob("*.jsonl"))
    report_s = _time(lambda: goodput.compute(read_run(run_dir).events), repeat=2)
    runs = RunSet(run_dir, record_alerts=False)
    try:
        t = time.perf_counter()
        runs.refresh()
        first_s = time.perf_counter() - t
        watch = runs.all()[0]
        last_step = watch.snapshot["figures"]["last_step"]
        ts = watch.snapshot["t1"]
        path = run_dir / "events" / "h-p100.jsonl"
        times, cpu = [], []
        for k in range(5):
            with open(path, "a") as f:
                f.write(
                    Event(
                        kind=ev.STEP,
                        ts=ts + k + 1,
                        run="long",
                        data={"step": last_step + k + 1, "dur_s": 0.2},
                    ).to_json()
                    + "\n"
                )
            t = time.perf_counter()
            watch.refresh()  # forced: the cost itself, not the budget's spacing
            times.append(time.perf_counter() - t)
            cpu.append(watch.compute_s)
        idle_s = _time(watch.refresh)
        registry = registry_for(runs, refresh=False)
        from prometheus_client import generate_latest

        metrics_s = _time(lambda: generate_latest(registry))
    finally:
        runs.close()
    return {
        "records": n,
        "ledger_mb": size / 1e6,
        "report_full_s": report_s,
        "dashboard_first_load_s": first_s,
        "refresh_after_a_step_s": statistics.median(times),
        "refresh_idle_s": idle_s,
        "metrics_render_s": metrics_s,
        "refresh_spacing_s": BUDGET_FACTOR * statistics.median(cpu),
    }


def _viewer(url: str, run: str, stop: threading.Event) -> None:
    """A browser's stream and a Prometheus scrape every second, until ``stop``."""

    def stream() -> None:
        try:
            with urllib.request.urlopen(f"{url}api/run/{run}/stream", timeout=30) as r:
                while not stop.is_set() and r.readline():
                    pass
        except OSError:
            pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    while not stop.wait(1.0):
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "metrics", timeout=10) as r:
            r.read()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _job(run_dir: Path, steps: int, *, watched: bool) -> tuple[float, float | None, float]:
    """(median step s, CPU seconds the dashboard used or None, job wall seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    dash = None
    stop = threading.Event()
    viewer = None
    run_dir.mkdir(parents=True)
    if watched:
        dash = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unbroken.cli",
                "dashboard",
                str(run_dir),
                "--port",
                "0",
                "--no-record-alerts",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert dash.stdout is not None
        url = dash.stdout.readline().split()[2]
        viewer = threading.Thread(target=_viewer, args=(url, run_dir.name, stop), daemon=True)
        viewer.start()
    t0 = time.monotonic()
    dash_cpu = None
    cpu0 = _cpu_s(dash.pid) if dash is not None else 0.0  # its start-up is not watching
    try:
        cmd = [
            sys.executable,
            "-m",
            "unbroken.launcher.cli",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--ft-run-dir",
            str(run_dir),
            "-m",
            "unbroken.workload.train",
            "--steps",
            str(steps),
            "--run-dir",
            str(run_dir),
            "--ckpt-every",
            "10",
        ]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            raise RuntimeError(f"job failed ({res.returncode}): {res.stderr[-2000:]}")
        if dash is not None:
            dash_cpu = _cpu_s(dash.pid) - cpu0
    finally:
        stop.set()
        if dash is not None:
            dash.terminate()
            dash.wait(timeout=30)
        if viewer is not None:
            viewer.join(timeout=5)
    wall = time.monotonic() - t0
    rep = goodput.compute(read_events(run_dir))
    assert rep.step_time_s_median is not None
    return rep.step_time_s_median, dash_cpu, wall


def step_time(root: Path, steps: int, trials: int) -> dict[str, Any]:
    alone: list[float] = []
    watched: list[float] = []
    cpu_share: list[float] = []
    for i in range(trials):
        for name in ("alone", "watched"):
            step_s, cpu, wall = _job(root / f"{name}-{i}", steps, watched=name == "watched")
            (alone if name == "alone" else watched).append(step_s)
            extra = ""
            if cpu is not None:
                cpu_share.append(cpu / wall)
                extra = f", dashboard CPU {cpu:.2f} s over {wall:.0f} s ({100 * cpu / wall:.1f}% of a core)"
            print(f"  {name} #{i}: median step {step_s * 1000:.1f} ms{extra}", flush=True)
    a, w = statistics.median(alone), statistics.median(watched)
    return {
        "steps": steps,
        "trials": trials,
        "alone_s": alone,
        "watched_s": watched,
        "alone_median_s": a,
        "watched_median_s": w,
        "ratio": w / a,
        "dashboard_cpu_share": cpu_share,
    }


def main(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        print(f"refresh cost on a {a.long_steps}-step run ...", flush=True)
        cost = refresh_cost(root, a.long_steps)
        print(f"  {cost['records']} records, {cost['ledger_mb']:.1f} MB")
        for key in (
            "report_full_s",
            "dashboard_first_load_s",
            "refresh_after_a_step_s",
            "refresh_idle_s",
            "metrics_render_s",
            "refresh_spacing_s",
        ):
            print(f"  {key:<26} {cost[key] * 1000:9.1f} ms")
        out: dict[str, Any] = {"refresh": cost}
        if not a.skip_job:
            print(
                f"step time of the reference job ({a.steps} steps, 2 ranks), alone vs watched:",
                flush=True,
            )
            st = step_time(root, a.steps, a.trials)
            out["step_time"] = st
            print(f"  alone   {st['alone_median_s'] * 1000:.1f} ms")
            print(f"  watched {st['watched_median_s'] * 1000:.1f} ms  (x{st['ratio']:.3f})")
            share = statistics.median(st["dashboard_cpu_share"])
            print(f"  the dashboard used {100 * share:.1f}% of one core while it watched")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0
