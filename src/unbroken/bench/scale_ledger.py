"""The ledger and ``unbroken report`` at scale: a synthetic run of ranks x steps records.

Stood in: the training processes. Each rank's ledger file is written directly, one JSON line
per record as ``ledger.Ledger`` writes them (``Event.to_json``): a process start, a step
record per step, an async checkpoint stage every 100 steps, and on every rank the records of
two faults (injected, detected, restart begin/end, a rolled-back step range). Measured: the
real ``unbroken report`` code (``ledger.read_run`` then ``ledger.goodput.compute``) in a fresh
Python process per size, its wall time and its peak resident memory (``VmHWM``, less an idle
interpreter's): as the CLI runs it (every other rank's steps folded into 16 bytes each) and,
up to a million records, unfolded (every record an ``Event``, as before), with equal reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev

T0 = 1_700_000_000.0
STEP_S = 1.0
FAULTS = (0.3, 0.7)  # at these fractions of the run


def _lines(rank: int, steps: int) -> list[str]:
    """One rank's ledger: every step, a save every 100 steps, two in-process restarts."""

    iteration = 0

    def rec(kind: str, ts: float, **data: Any) -> str:
        e = ev.Event(kind=kind, ts=ts, run="scale", rank=rank, iteration=iteration, data=data)
        return e.to_json()

    out = [rec(ev.PROCESS_START, T0 - 5, pid=1000 + rank, host="stand-in")]
    fault_at = {int(f * steps) for f in FAULTS}
    t = T0
    step = 0
    while step < steps:
        t += STEP_S
        out.append(rec(ev.STEP, t, step=step, dur_s=STEP_S, loss=2.0))
        if step % 100 == 99:
            t += 0.01
            out.append(rec(ev.CKPT_STAGE, t, step=step, dur_s=0.01, bytes=1 << 20))
        if step in fault_at:
            fault_at.discard(step)
            if rank == 0:
                out.append(rec(ev.FAULT_INJECTED, t + 0.01, fault="exception", step=step))
            out.append(rec(ev.FAULT_DETECTED, t + 0.02, cause="exception", layer="inprocess"))
            out.append(rec(ev.RESTART_BEGIN, t + 0.03, layer="inprocess"))
            t += 1.0
            out.append(rec(ev.RESTART_END, t, layer="inprocess"))
            iteration += 1
            step -= 3  # rolled back to the last memory snapshot
        step += 1
    return out


def write_run(root: Path, *, ranks: int, steps: int) -> int:
    """The ledger files of a synthetic run under ``root/events``; returns the record count."""
    events = root / "events"
    events.mkdir(parents=True)
    total = 0
    for rank in range(ranks):
        lines = _lines(rank, steps)
        total += len(lines)
        (events / f"rank-{rank:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return total


_CHILD = """
import json, sys, time
from unbroken.ledger import goodput, read_run
fold = sys.argv[2] == "fold"
t = time.perf_counter()
result = read_run(sys.argv[1], fold_steps_except=0 if fold else None)
read_s = time.perf_counter() - t
t = time.perf_counter()
rep = goodput.compute(result.events, digest=result.digest)
compute_s = time.perf_counter() - t
hwm = 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        hwm = int(line.split()[1]) * 1024
records = len(result.events) + (result.digest.count if result.digest else 0)
print(json.dumps({"read_s": read_s, "compute_s": compute_s, "peak_rss_bytes": hwm,
                  "records": records, "report": rep.to_dict()}))
"""
UNFOLDED_MAX = 1_100_000
"""Above this many records the unfolded report (every record an Event) is not run: ~1 GB
per million records."""


def _report(run_dir: str, mode: str) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, run_dir, mode], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"the report ({mode}) of {run_dir} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def _baseline_rss() -> int:
    """Peak resident memory of an interpreter that imported the report code and read nothing."""
    code = (
        "from unbroken.ledger import goodput, read_run\n"
        "print([int(x.split()[1]) * 1024 for x in open('/proc/self/status') "
        "if x.startswith('VmHWM:')][0])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def measure(ranks: int, steps: int, *, base_rss: int | None = None) -> dict[str, Any]:
    """Write a ``ranks`` x ``steps`` run, then time ``unbroken report``'s code on it: as the
    CLI runs it (other ranks' steps folded) and, up to ``UNFOLDED_MAX`` records, unfolded."""
    base = _baseline_rss() if base_rss is None else base_rss
    with tempfile.TemporaryDirectory(prefix="unbroken-scale-ledger-") as tmp:
        t = time.perf_counter()
        records = write_run(Path(tmp), ranks=ranks, steps=steps)
        write_s = time.perf_counter() - t
        size = sum(p.stat().st_size for p in (Path(tmp) / "events").iterdir())
        got, wall = _report(tmp, "fold")
        row: dict[str, Any] = {
            "ranks": ranks,
            "steps": steps,
            "records": records,
            "ledger_bytes": size,
            "write_s": write_s,
            "report_s": wall,
            "read_s": got["read_s"],
            "compute_s": got["compute_s"],
            "report_memory_bytes": got["peak_rss_bytes"] - base,
        }
        if got["records"] != records or len(got["report"]["faults"]) != len(FAULTS):
            raise RuntimeError(f"the report of {ranks} x {steps} read {got['records']} records")
        if records <= UNFOLDED_MAX:
            full, wall = _report(tmp, "full")
            if full["report"] != got["report"]:
                raise RuntimeError(f"folding changed the report of {ranks} x {steps}")
            row["unfolded_report_s"] = wall
            row["unfolded_report_memory_bytes"] = full["peak_rss_bytes"] - base
    return row
