"""``unbroken dashboard PATH``: flags, start-up, and the wait until Ctrl-C or SIGTERM.

Imports stay inside ``main`` so that building the ``unbroken`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", help="a run directory (--run-dir of a job) or a folder of them"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument(
        "--refresh-s", type=float, default=1.0, help="seconds between two reads of the ledgers"
    )
    p.add_argument(
        "--alerts",
        metavar="YAML",
        help="alert thresholds, a mapping of: recurring_count, recurring_window_s, "
        "no_progress_restarts, budget_ratio, max_commit_age_s, goodput_window_s, min_goodput, "
        "skipped_in_a_row",
    )
    p.add_argument(
        "--webhook", metavar="URL", help="POST new alerts here in Alertmanager's webhook format"
    )
    p.add_argument(
        "--kb",
        metavar="DB",
        help="knowledge base searched from the index (default: $UNBROKEN_KB or runs/kb.sqlite)",
    )
    p.add_argument(
        "--no-record-alerts",
        action="store_true",
        help="show alerts without writing them to the runs' ledgers",
    )


def main(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 2 with a message when the path or the port is unusable."""
    from unbroken.dashboard.alerts import AlertConfig
    from unbroken.dashboard.runs import RunSet, RunWatch
    from unbroken.dashboard.server import DashboardServer
    from unbroken.dashboard.webhook import Webhook
    from unbroken.kb import default_path

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535, got {args.port}")
    cfg = AlertConfig.from_yaml(args.alerts) if args.alerts else AlertConfig()
    webhook = Webhook(args.webhook) if args.webhook else None

    def on_alerts(w: RunWatch, fresh: list[Any]) -> None:
        if webhook is not None:
            webhook.send(fresh, run=w.report.run if w.report is not None else w.name)

    runs = RunSet(
        Path(args.path).absolute(),
        alert_config=cfg,
        record_alerts=not args.no_record_alerts,
        on_alerts=on_alerts,
        refresh_s=args.refresh_s,
    )
    kb = Path(args.kb) if args.kb else default_path()
    try:
        server = DashboardServer(runs, host=args.host, port=args.port, kb_path=kb)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        if webhook is not None:
            webhook.close()
        return 2
    done = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    runs.start()
    server.start()
    n = len(runs.all())
    what = f"run {runs.all()[0].name}" if runs.single and n else f"{n} run(s) under {runs.root}"
    print(f"unbroken dashboard: {server.url} ({what}; Ctrl-C to stop)", flush=True)
    try:
        done.wait()
    finally:
        server.close()
        runs.close()
        if webhook is not None:
            webhook.close()
    return 0
