"""The process group of one iteration: form it, abort it, tear it down off the critical path.

What unblocks a collective (torch 2.13, see the bench docs):
- gloo: ``ProcessGroupGloo.abort()``, ``_abort_process_group()`` and
  ``destroy_process_group()`` all return at once but leave a collective that waits for a live
  peer blocked (it returns only when the peer's process exits). What does unblock it is its
  TCP connections going away. So ``Transport.close`` calls ``shutdown(2)`` on the group's pair
  sockets: the local collective fails at once ("Connection closed by peer"),
  and the FIN makes every peer's collective on those connections fail too, so one rank's abort
  frees the others even when they are stuck in native code. The group's listening socket is
  left alone (shutting it down aborts the process inside gloo's accept loop).
- NCCL: ``ProcessGroupNCCL.abort()`` (``_abort_process_group``), callable from any thread.

Pair sockets are found without gloo's help: the TCP sockets of this process that are
ESTABLISHED and were not open before the group was formed (``/proc/self/fd`` against
``/proc/net/tcp{,6}``), minus connections to the coordination store. Sub-groups formed inside
``fn`` are covered; a socket that user code opened inside ``fn`` would be shut down too.

Tearing down: ``teardown`` clears torch's process-group registry on the main thread (so a new
default group can be formed at once) and hands the old group objects to a reaper thread. What
``fn`` built (an FSDP model, its group) sits in reference cycles, so only the cyclic garbage
collector frees it - and its sockets, and on a GPU its memory. The reaper runs that collection
while the ranks meet in the store; the next iteration starts once it is done. ``run`` freezes
the objects that exist before it starts (``gc.freeze``), and again after each collection, so
a collection only walks what the failed iteration built, not the many objects of a process
that imported torch (and more after FSDP's first use imported the rest).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unbroken.restart.config import Backend

logger = logging.getLogger(__name__)

_TCP_ESTABLISHED = 0x01
_SHUT_RDWR = socket.SHUT_RDWR
_libc = ctypes.CDLL(None, use_errno=True)


def _socket_inodes() -> dict[int, int]:
    """inode -> fd of every socket this process has open."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _tcp_table() -> dict[int, tuple[int, int, int]]:
    """inode -> (state, local port, remote port) of every TCP socket in this namespace."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, remote = fields[1], fields[2]
            out[int(fields[9])] = (
                int(fields[3], 16),
                int(local.rsplit(":", 1)[1], 16),
                int(remote.rsplit(":", 1)[1], 16),
            )
    return out


class Transport:
    """The connections of the process groups formed after construction."""

    def __init__(self, *, keep_ports: Iterable[int] = ()) -> None:
        """``keep_ports``: connections from or to these ports stay (the store's)."""
        self._before = frozenset(_socket_inodes())
        self._keep_ports = frozenset(keep_ports)
        self._lock = threading.Lock()
        self.closed = 0
        """Sockets shut down so far."""

    def close(self) -> int:
        """Shut down the groups' connections (any thread, no blocking I/O); returns how many."""
        with self._lock:
            n = 0
            table = _tcp_table()
            for inode, fd in _socket_inodes().items():
                entry = table.get(inode)
                if inode in self._before or entry is None:
                    continue
                state, local_port, remote_port = entry
                if state != _TCP_ESTABLISHED or not self._keep_ports.isdisjoint(
                    (local_port, remote_port)
                ):
                    continue
                try:
                    if os.fstat(fd).st_ino != inode:  # the fd was closed and reused meanwhile
                        continue
                except OSError:
                    continue
                if _libc.shutdown(fd, _SHUT_RDWR) == 0:
                    n += 1
            self.closed += n
            _abort_nccl()
            return n


def _abort_nccl() -> None:
    """Abort every NCCL communicator (thread-safe in torch); gloo groups have none."""
    if not (dist.is_available() and dist.is_nccl_available() and dist.is_initialized()):
        return
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except RuntimeError:
            continue
        try:
            backend.abort()
        except Exception:  # noqa: BLE001 - best effort on an already broken group
            logger.exception("NCCL abort failed")


def default_backend() -> Backend:
    return "nccl" if torch.cuda.is_available() else "gloo"


def form(
    store: dist.Store,
    *,
    prefix: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    local_rank: int,
) -> None:
    """Initialize the default process group on ``store`` under ``prefix``."""
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists; unbroken.restart.run forms it, so do "
            "not call init_process_group before or inside fn"
        )
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


class Reaper:
    """Runs cleanup on its own thread: drops references (so expensive destructors run off the
    main path) and runs callables (e.g. formatting a traceback for the log)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._queued = 0
        self._done = 0

    def drop(self, obj: Any) -> None:
        """Release ``obj`` (the caller must hold no other reference)."""
        self._put((None, obj))

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the reaper thread."""
        self._put((fn, None))

    def wait(self, timeout_s: float = 30.0) -> bool:
        """Block until everything queued so far is done; False on timeout."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout=timeout_s)

    def _put(self, item: tuple[Any, Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="unbroken-restart-reaper", daemon=True
            )
            self._thread.start()
        with self._cond:
            self._queued += 1
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, obj = item
            del item, obj
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - cleanup must never end the reaper
                    logger.exception("cleanup failed")
                del fn
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("reaper still destroying process groups after %.0fs", timeout_s)
            self._thread = None


def teardown(reaper: Reaper, *, abort: bool) -> None:
    """Clear every process group from torch's registry (main thread); the reaper frees them.

    ``abort``: the groups are broken (abort NCCL communicators rather than finalize them).
    """
    if not dist.is_initialized():
        return
    groups = list(dist.distributed_c10d._world.pg_map)
    try:
        aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort and aborter is not None:
            aborter()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the registry must be cleared whatever the backend says
        logger.exception("process group teardown failed; clearing the registry")
        if dist.is_initialized():
            dist.destroy_process_group()
    reaper.drop(groups)
