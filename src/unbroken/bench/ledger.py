"""``unbroken bench ledger``: what a ledger record costs the training thread.

Side by side in one run: our queued ``Ledger.emit``; a synchronous ``os.write`` of the same
JSON line per record; and a synchronous write + fsync per record (what "durable at once" costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.ledger import Ledger, read_events
from unbroken.ledger import events as ev


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", type=int, default=20000, help="records per configuration")
    p.add_argument("--fsync-records", type=int, default=300, help="records for the fsync case")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument("--dir", default=None, help="directory to write in (default: a temp dir)")


def _summary(name: str, lat_s: list[float], extra: dict[str, Any]) -> dict[str, Any]:
    lat = sorted(lat_s)
    return {
        "config": name,
        "records": len(lat),
        "median_us": statistics.median(lat) * 1e6,
        "p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e6,
        "max_us": lat[-1] * 1e6,
        **extra,
    }


def _bench_ledger(root: Path, n: int) -> dict[str, Any]:
    led = Ledger(root / "queued", run="bench", rank=0)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        led.emit(ev.STEP, step=i, dur_s=0.01, loss=1.0)
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    led.close()
    drain_s = time.perf_counter() - t
    got = len(read_events(root / "queued"))
    if got != n:
        raise RuntimeError(f"ledger lost records: wrote {n}, read back {got}")
    return _summary("ledger.emit (queued)", lat, {"close_s": drain_s, "read_back": got})


def _bench_sync(root: Path, n: int, *, fsync: bool) -> dict[str, Any]:
    path = root / ("fsync.jsonl" if fsync else "sync.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    lat = []
    try:
        for i in range(n):
            t = time.perf_counter()
            line = ev.Event(kind=ev.STEP, run="bench", data={"step": i, "dur_s": 0.01}).to_json()
            os.write(fd, (line + "\n").encode())
            if fsync:
                os.fsync(fd)
            lat.append(time.perf_counter() - t)
    finally:
        os.close(fd)
    name = "write+fsync per record" if fsync else "os.write per record"
    return _summary(name, lat, {})


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        rows = [
            _bench_ledger(root, args.records),
            _bench_sync(root, args.records, fsync=False),
            _bench_sync(root, args.fsync_records, fsync=True),
        ]
    base = rows[0]["median_us"]
    print(
        f"{'config':<26} {'records':>8} {'median us':>10} {'p99 us':>9} {'max us':>9} {'x ours':>7}"
    )
    for r in rows:
        r["ratio_to_ledger"] = r["median_us"] / base
        print(
            f"{r['config']:<26} {r['records']:>8} {r['median_us']:>10.1f} {r['p99_us']:>9.1f} "
            f"{r['max_us']:>9.1f} {r['ratio_to_ledger']:>7.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
