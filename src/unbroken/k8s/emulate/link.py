"""A degraded link between emulated pods: every packet delayed, some dropped, for a while.

The kernel here has no ``sch_netem`` (``tc qdisc ... netem`` is unknown) and no iptables, so
the link is emulated in user space, with real packets: in the degraded pod's network namespace
and in each peer's, a TUN device gets a host route to the other end (more specific than the
pods' /16 on ``eth0``), so the kernel sends what one end sends the other into the TUN instead
of over the bridge; existing TCP connections follow (a route change invalidates their cached
route). A forwarder process reads each packet from one TUN, drops it with probability
``loss`` percent (a seeded random sequence), else writes it into the other end's TUN after
``delay_ms`` ms, where the kernel receives it as if it came off the wire. Each direction is
delayed and thinned on its own, as ``netem`` on both ends would do: a round trip takes
``2 x delay_ms`` more; a lost segment is retransmitted by TCP, as on a real lossy link.

When the window ends the routes go (new packets take the bridge again), the packets still
queued are delivered at their time, and the TUN devices close, which removes them with any
route left. A forwarder that is killed closes them just the same: the links come back whole,
nothing is left in any namespace. It ends, restoring them, with the process that started it,
and SIGTERM ends its window early.

Runs as a script (``python -I link.py SPEC``: the standard library only); ``Cluster.degrade``
starts it (``start``). Linux, IPv4, root.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
IFNAME = "ublink0"
"""The TUN device's name in each namespace (one degraded link set per pod at a time)."""
READY_TIMEOUT_S = 10.0
TUN_QUEUE = 10000
"""Packets a TUN device holds for the forwarder (the kernel's default: 500). A forwarder that a
busy machine's trainers keep off a CPU for a moment must find them queued, as a router's
buffer holds them, not dropped: the link loses ``loss`` percent, not what it could not read."""
FORWARDER_NICE = -10
"""The forwarder's niceness: it is the network, and runs before the trainers it carries."""
ORPHAN_CHECK_S = 0.2
"""How often an idle forwarder checks that the process that started it is alive."""


@dataclass(frozen=True, kw_only=True)
class End:
    """One end of the degraded links: a pod's namespace and address."""

    netns: str
    ip: str


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _open_tun(netns: str) -> int:
    """A TUN device named IFNAME in ``netns``, opened from this (the host's) namespace."""
    libc = _libc()
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(
                    fd, TUNSETIFF, struct.pack("16sH", IFNAME.encode(), IFF_TUN | IFF_NO_PI)
                )
            except OSError:
                os.close(fd)
                raise
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # never stay in a pod's namespace
                os._exit(70)
    finally:
        os.close(own)
        os.close(target)
    os.set_blocking(fd, False)
    return fd


def _ip(netns: str, *args: str) -> None:
    done = subprocess.run(["ip", "-n", netns, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip -n {netns} {' '.join(args)}: {done.stderr.strip()}")


class Forwarder:
    """The links between ``end`` and each of ``peers``, degraded (see the module docstring)."""

    def __init__(
        self, end: End, peers: list[End], *, delay_ms: float, loss: float, seed: int
    ) -> None:
        self.delay_s = delay_ms / 1000.0
        self.loss = loss / 100.0
        self.rng = random.Random(seed)
        self.fds: dict[str, int] = {}  # netns -> TUN fd
        self.out: dict[bytes, int] = {}  # destination address (4 bytes) -> the TUN it enters
        self.routes: list[tuple[str, str]] = []  # (netns, destination) installed
        self.queue: list[tuple[float, int, int, bytes]] = []
        self.seq = 0
        self.stats = {"forwarded": 0, "dropped": 0, "bytes": 0}
        try:
            for e in [end, *peers]:
                self.fds[e.netns] = _open_tun(e.netns)
                _ip(e.netns, "link", "set", IFNAME, "txqueuelen", str(TUN_QUEUE), "up")
            for peer in peers:
                self._route(end, peer)
                self._route(peer, end)
        except BaseException:
            self.close()
            raise

    def _route(self, src: End, dst: End) -> None:
        """Packets from ``src`` to ``dst`` enter ``src``'s TUN; they leave by ``dst``'s."""
        _ip(src.netns, "route", "add", f"{dst.ip}/32", "dev", IFNAME, "src", src.ip)
        self.routes.append((src.netns, dst.ip))
        self.out[bytes(int(x) for x in dst.ip.split("."))] = self.fds[dst.netns]

    def _take(self, fd: int, now: float) -> None:
        while True:
            try:
                pkt = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:  # the namespace is gone (its pod ended)
                return
            if len(pkt) < 20 or pkt[0] >> 4 != 4:
                continue  # not IPv4 (router solicitations of the new device, ...)
            out = self.out.get(pkt[16:20])
            if out is None:
                continue
            if self.loss and self.rng.random() < self.loss:
                self.stats["dropped"] += 1
                continue
            self.seq += 1
            heapq.heappush(self.queue, (now + self.delay_s, self.seq, out, pkt))

    def _deliver(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, out, pkt = heapq.heappop(self.queue)
            with contextlib.suppress(OSError):  # an end that went away
                os.write(out, pkt)
                self.stats["forwarded"] += 1
                self.stats["bytes"] += len(pkt)

    def run(self, until: float) -> None:
        """Forward until ``until`` (epoch seconds) or SIGTERM, then restore the links."""
        fds = list(self.fds.values())
        stop = False

        def on_term(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_term)
        parent = os.getppid()
        while not stop and os.getppid() == parent:  # it dies with whoever started it
            now = time.time()
            if now >= until:
                break
            wait = min(until - now, ORPHAN_CHECK_S)
            if self.queue:
                wait = min(wait, max(0.0, self.queue[0][0] - now))
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select(fds, [], [], wait)
                now = time.time()
                for fd in ready:
                    self._take(fd, now)
            self._deliver(time.time())
        self._unroute()
        # What is queued still arrives, at its time (a packet in flight is not lost).
        while self.queue and not stop:
            time.sleep(max(0.0, self.queue[0][0] - time.time()))
            self._deliver(time.time())
        self.close()

    def _unroute(self) -> None:
        for netns, dst in self.routes:
            with contextlib.suppress(OSError):
                _ip(netns, "route", "del", f"{dst}/32", "dev", IFNAME)
        self.routes = []

    def close(self) -> None:
        self._unroute()
        for fd in self.fds.values():
            os.close(fd)  # a TUN device without an owner is removed, with its routes
        self.fds = {}


def start(
    end: End, peers: list[End], *, delay_ms: float, loss: float, seconds: float, seed: int = 0
) -> tuple[subprocess.Popen[str], dict[str, float]]:
    """Start a forwarder process; returns it once the links are degraded, with its ready
    message (``ts``: when, ``until``). Raises OSError (with the forwarder's error) when it
    could not degrade them, or not within READY_TIMEOUT_S."""
    spec = {
        "end": end.__dict__,
        "peers": [p.__dict__ for p in peers],
        "delay_ms": delay_ms,
        "loss": loss,
        "seconds": seconds,
        "seed": seed,
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(spec)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("{"):
        proc.kill()
        _, err = proc.communicate()
        raise OSError(f"the link emulator did not start: {(line + err).strip() or 'timeout'}")
    return proc, json.loads(line)


def finish(proc: subprocess.Popen[str], *, timeout_s: float = 5.0) -> dict[str, int]:
    """End a forwarder (its window, if not over) and return its counts: ``forwarded``,
    ``dropped`` packets and ``bytes`` forwarded ({} if it could not say)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    for line in reversed(out.splitlines()):
        if line.startswith('{"forwarded"'):
            return dict(json.loads(line))
    return {}


def _main(raw: str) -> int:
    spec = json.loads(raw)
    with contextlib.suppress(OSError):  # root (the emulated cluster needs it anyway)
        os.setpriority(os.PRIO_PROCESS, 0, FORWARDER_NICE)
    try:
        fwd = Forwarder(
            End(**spec["end"]),
            [End(**p) for p in spec["peers"]],
            delay_ms=float(spec["delay_ms"]),
            loss=float(spec["loss"]),
            seed=int(spec["seed"]),
        )
    except OSError as e:
        print(f"error: {e}", flush=True)
        return 1
    now = time.time()
    until = now + float(spec["seconds"])
    print(json.dumps({"ts": now, "until": until}), flush=True)
    fwd.run(until)
    print(json.dumps(fwd.stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
