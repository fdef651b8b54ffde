"""``python -m unbroken.restart.store_server``: the coordination store as its own process.

Started by rank 0's process when no launcher hosts a store. Prints ``port=<n>`` once it
listens, then serves until

- ``stop`` arrives on stdin (the clean end of a run), or
- its parent is gone (stdin reaches EOF) and every process registered in the store on this
  host has exited: the store outlives rank 0 (a rank that dies must not take the store with
  it) but not the whole job.

Processes register under ``unbroken/store/pid/<n>`` (``store.register``); ``<n>`` from the
counter ``unbroken/store/npids``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from unbroken.restart.store import NPIDS_KEY, PID_KEY

_POLL_S = 0.5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local_pids(store: object) -> list[int]:
    n = store.add(NPIDS_KEY, 0)  # type: ignore[attr-defined]
    keys = [PID_KEY.format(i) for i in range(1, n + 1)]
    host = socket.gethostname()
    pids = []
    for raw in store.multi_get(keys) if keys else []:  # type: ignore[attr-defined]
        h, _, pid = raw.decode().rpartition(":")
        if h == host:
            pids.append(int(pid))
    return pids


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unbroken.restart.store_server")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    args = p.parse_args(argv)

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        args.port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )
    sys.stdout.write(f"port={store.port}\n")
    sys.stdout.flush()

    stop = threading.Event()
    orphaned = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                stop.set()
                return
        orphaned.set()

    threading.Thread(target=read_stdin, name="store-stdin", daemon=True).start()
    while not stop.wait(_POLL_S):
        if orphaned.is_set() and not any(_alive(pid) for pid in _local_pids(store)):
            break
    # Give clients that raced the stop a moment to read their last answers.
    time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
