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

from unbroken.ledger.owner import pid_alive
from unbroken.restart.store import NPIDS_KEY, PID_KEY

_POLL_S = 0.5


def _local_pids(store: object) -> list[int]:
    n = store.add(NPIDS_KEY, 0)  # type: ignore[attr-defined]
    keys = [PID_KEY.format(i) for i in range(1, n + 1)]
    host = socket.gethostname()
    pids = []
    for raw in store.multi_get(keys) if keys else []:  # type: ignore[attr-defined]
        h, _, pid = raw.decode(errors="replace").rpartition(":")
        if h == host and pid.isdigit():  # anything else is not a registration of ours
            pids.append(int(pid))
    return pids


def _listen(host: str, port: int, timeout: timedelta) -> object:
    """A TCPStore server listening on ``host`` only (torch's alone listens on every interface:
    it adopts a socket bound here); ``host`` "": every interface."""
    import torch.distributed as dist

    if not host:
        return dist.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout
        )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    store = dist.TCPStore(
        host,
        sock.getsockname()[1],
        None,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store owns it now
    return store


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unbroken.restart.store_server")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on ('': every one)")
    args = p.parse_args(argv)

    store = _listen(args.host, args.port, timedelta(seconds=30))
    sys.stdout.write(f"port={store.port}\n")  # type: ignore[attr-defined]
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
        try:
            pids = _local_pids(store) if orphaned.is_set() else [os.getpid()]
        except RuntimeError as e:  # the store is ours: it answers unless it is shutting down
            print(f"store_server: cannot read registrations: {e}", file=sys.stderr)
            pids = [os.getpid()]
        if not any(pid_alive(pid) for pid in pids):
            break
    # Give clients that raced the stop a moment to read their last answers.
    time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
