"""The coordination store: where it lives, how to reach it, and the keys of one run.

Never inside a training process (a rank that hangs or dies must not take the store with it).
In order of preference:

1. ``RestartConfig.store_addr``, then ``UNBROKEN_STORE_ADDR=host:port``: a store hosted by the
   launcher agent (``unbroken-run`` sets this), or by anything else outside the ranks.
2. torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``): ``MASTER_ADDR:MASTER_PORT``
   is served by the torchrun agent, not by a rank.
3. Launched, but the launcher hosts no store (``MASTER_ADDR`` set, no agent store): rank 0's
   process starts ``python -m unbroken.restart.store_server`` and publishes its address in the
   bootstrap store at ``MASTER_ADDR:MASTER_PORT`` (served by rank 0, as torch's ``env://``
   does; used for that one key only).
4. Not launched (one process): as 3, without the bootstrap.

Keys of a run live under ``unbroken/<run>/a<attempt>/`` (the launcher attempt), those of an
iteration under ``.../i<iteration>/``, so no round ever reads another's keys, and every
iteration forms its process group under a fresh prefix.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from unbroken import env as uenv
from unbroken.env import WorkerEnv
from unbroken.restart.config import RestartError, parse_addr

logger = logging.getLogger(__name__)

# Processes using a store started by store_server register here (it serves until they exit).
NPIDS_KEY = "unbroken/store/npids"
PID_KEY = "unbroken/store/pid/{}"


class StoreUnavailable(RestartError):  # noqa: N818
    """The coordination store could not be reached or started."""


@dataclass(frozen=True)
class Keys:
    """Key names of one run attempt; the ``i*`` methods take the iteration."""

    root: str
    """``unbroken/<run>/a<attempt>/``."""

    @classmethod
    def for_run(cls, *, run: str, attempt: int) -> Keys:
        return cls(f"unbroken/{run}/a{attempt}/")

    def it(self, iteration: int) -> str:
        return f"{self.root}i{iteration}/"

    def pg_prefix(self, iteration: int) -> str:
        return f"{self.it(iteration)}pg/"

    def wake(self, iteration: int, member: int) -> str:
        return f"{self.it(iteration)}wake/{member}"

    def reports(self, iteration: int) -> str:
        return f"{self.it(iteration)}reports"

    def exit(self, iteration: int, member: int) -> str:
        return f"{self.it(iteration)}exit/{member}"

    def present(self, iteration: int) -> str:
        return f"{self.it(iteration)}present"

    def health(self, iteration: int, member: int) -> str:
        return f"{self.it(iteration)}health/{member}"

    def decision(self, iteration: int) -> str:
        return f"{self.it(iteration)}decision"

    def bye(self, member: int) -> str:
        return f"{self.root}bye/{member}"

    def store_addr(self) -> str:
        return f"{self.root}store_addr"


class StoreHost:
    """Where the coordination store is, and the server process if this process started it."""

    def __init__(self, host: str, port: int, *, server: subprocess.Popen[str] | None) -> None:
        self.host = host
        self.port = port
        self.server = server
        self.bootstrap: dist.TCPStore | None = None
        """The bootstrap store this process serves (rank 0 in case 3), kept until close."""

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, *, timeout_s: float) -> dist.TCPStore:
        """A new connection (one per thread that blocks on the store)."""
        try:
            return dist.TCPStore(
                self.host,
                self.port,
                is_master=False,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, dist.DistStoreError) as e:
            raise StoreUnavailable(
                f"cannot reach the coordination store at {self.addr}: {e}; check "
                f"{uenv.UNBROKEN_STORE_ADDR} or the launcher's store"
            ) from e

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Stop the server process if we started it; idempotent."""
        server, self.server = self.server, None
        if server is not None:
            try:
                assert server.stdin is not None
                server.stdin.write("stop\n")
                server.stdin.flush()
                server.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                server.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("store server %d did not stop; killing it", server.pid)
                server.kill()
                server.wait()
            if server.stdout is not None:
                server.stdout.close()
        self.bootstrap = None


def bind_host(host: str, *, single_node: bool) -> str:
    """Where a store that peers reach as ``host`` listens: the address ``host`` resolves to here
    (loopback for a single-node job), "" (every interface) when that is unknown or is a
    loopback address in a multi-node job."""
    try:
        addr = str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError, ValueError, IndexError):
        return ""
    if ipaddress.ip_address(addr).is_loopback:  # exactly that one (127.0.1.1 is not 127.0.0.1)
        return addr if single_node else ""
    return addr


def spawn_server(*, timeout_s: float, host: str = "127.0.0.1") -> tuple[subprocess.Popen[str], int]:
    """Start ``store_server`` as a child process listening on ``host`` ("": every interface);
    returns it and its port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken.restart.store_server", "--port", "0", "--host", host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    if not line.startswith("port="):
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise StoreUnavailable(
            f"the store server did not start within {timeout_s}s (exit {proc.returncode}, "
            f"said {line!r}); is unbroken importable by {sys.executable}?"
        )
    return proc, int(line.strip().split("=", 1)[1])


def locate(
    env: WorkerEnv, *, keys: Keys, override: str | None, timeout_s: float
) -> tuple[StoreHost, bool]:
    """Find (or start) the coordination store; returns it and whether we must register in it
    (stores started by ``store_server`` watch their registered processes)."""
    addr = override or env.store_addr
    if addr:
        host, port = parse_addr(addr)
        return StoreHost(host, port, server=None), False
    if env.launched and env.use_agent_store:
        assert env.master_addr is not None and env.master_port is not None
        return StoreHost(env.master_addr, env.master_port, server=None), False
    if not env.launched:
        if env.world_size != 1:
            raise ValueError(
                f"{uenv.WORLD_SIZE}={env.world_size} but no {uenv.MASTER_ADDR}: set "
                f"{uenv.UNBROKEN_STORE_ADDR} or launch with a launcher"
            )
        proc, port = spawn_server(timeout_s=timeout_s)
        return StoreHost("127.0.0.1", port, server=proc), True
    # Launched without an agent store: bootstrap through MASTER_ADDR:MASTER_PORT.
    assert env.master_addr is not None and env.master_port is not None
    timeout = timedelta(seconds=timeout_s)
    boot = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    if env.rank == 0:
        single = env.local_world_size == env.world_size
        proc, port = spawn_server(
            timeout_s=timeout_s, host=bind_host(env.master_addr, single_node=single)
        )
        spawned = StoreHost(env.master_addr, port, server=proc)
        spawned.bootstrap = boot
        boot.set(keys.store_addr(), spawned.addr)
        return spawned, True
    boot.wait([keys.store_addr()], timeout)
    h, p = parse_addr(boot.get(keys.store_addr()).decode())
    return StoreHost(h, p, server=None), True


def register(client: dist.TCPStore) -> None:
    """Tell a store started by ``store_server`` that this process uses it."""
    n = client.add(NPIDS_KEY, 1)
    client.set(PID_KEY.format(n), f"{socket.gethostname()}:{os.getpid()}")
