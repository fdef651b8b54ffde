"""The rendezvous store's process: a c10d TCPStore server that no training node hosts.

``unbroken k8s store --port 29400`` runs in its own pod (a one-replica Deployment behind a
Service, ``<name>-rdzv``). Every ``unbroken-run`` of the job is its client: torch's c10d
rendezvous keeps its membership state there, unbroken-run its round counter and exit barrier,
and the workers' in-process restart its coordination keys. Because the store lives apart from
every node, the loss of any node, index 0 included, leaves the survivors' rendezvous intact:
they re-form the job with a hot spare or a replacement pod.

The process serves until SIGTERM or SIGINT (Kubernetes' stop), then exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from datetime import timedelta

logger = logging.getLogger(__name__)


def serve(*, host: str, port: int, ready: threading.Event | None = None) -> int:
    """Serve a TCPStore on ``host:port`` until SIGTERM/SIGINT; returns the exit code."""
    import torch.distributed as dist

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s: stopping the rendezvous store", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            store = dist.TCPStore(
                host, port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
            )
        except Exception as e:
            logger.error("cannot serve the rendezvous store on %s:%d: %s", host, port, e)
            return 1
        logger.info("rendezvous store serving on %s:%d", host, store.port)
        print(f"rendezvous store serving on port {store.port}", flush=True)
        if ready is not None:
            ready.set()
        while not stop.wait(1.0):
            pass
        del store
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=29400, help="port to serve on (0: any free one)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: every one)")


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0-65535, got {args.port}")
    return serve(host=args.host, port=args.port)
