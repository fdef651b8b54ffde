"""Loss on a process's own TCP connections, read from the kernel: nothing on a healthy link,
segments resent on a lossy one (real packets dropped between two pod namespaces), and a peer
whose link is cut becomes unreachable."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from unbroken.k8s.emulate import link
from unbroken.k8s.emulate.net import NetnsNetwork, PodNet, netns_unavailable
from unbroken.ledger.busy import proc_tcp_retransmitting
from unbroken.restart.lossy import Loss, OwnConnections

netns = pytest.mark.skipif(netns_unavailable() is not None, reason=f"{netns_unavailable()}")

SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000))
s.listen()
print("listening", flush=True)
c, _ = s.accept()
while data := c.recv(65536):
    c.sendall(data)
"""
CLIENT = """
import json, socket, sys, time
from unbroken.restart.lossy import OwnConnections
c = socket.create_connection((sys.argv[1], 9000))
conns = OwnConnections(relist_s=0.0)
base = conns.loss()
for line in sys.stdin:
    cmd, n = line.split()
    if cmd == "echo":  # n round trips of 10 kB
        for _ in range(int(n)):
            c.sendall(b"x" * 10_000)
            got = 0
            while got < 10_000:
                got += len(c.recv(65536))
    else:  # "push": send 10 kB (unanswered), then watch for n seconds
        c.sendall(b"x" * 10_000)
        end = time.monotonic() + float(n)
        while time.monotonic() < end and not conns.loss().unreachable:
            time.sleep(0.05)
    loss = conns.loss()
    print(json.dumps([loss.since(base), loss.unreachable]), flush=True)
"""


class Client:
    """An echo server in pod b, and a client in pod a that reports its own connections."""

    def __init__(self, a: PodNet, b: PodNet) -> None:
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", str(b.netns), sys.executable, "-c", SERVER],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.server.stdout is not None and self.server.stdout.readline() == "listening\n"
        self.client = subprocess.Popen(
            ["ip", "netns", "exec", str(a.netns), sys.executable, "-c", CLIENT, b.ip],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, cmd: str, n: float) -> tuple[int, bool]:
        """(segments lost since the connection opened, unreachable) after ``cmd``."""
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(f"{cmd} {n}\n")
        self.client.stdin.flush()
        lost, unreachable = json.loads(self.client.stdout.readline())
        return lost, unreachable

    def close(self) -> None:
        for p in (self.client, self.server):
            p.kill()
            p.wait()


@pytest.fixture
def pods() -> Iterator[tuple[NetnsNetwork, PodNet, PodNet]]:
    net = NetnsNetwork()
    try:
        yield net, net.attach("a"), net.attach("b")
    finally:
        net.close()


@netns
def test_a_lossy_link_shows_lost_segments_and_a_cut_one_an_unreachable_peer(
    pods: tuple[NetnsNetwork, PodNet, PodNet],
) -> None:
    net, a, b = pods
    client = Client(a, b)
    try:
        assert client.ask("echo", 20) == (0, False)  # healthy: nothing lost
        ends = (link.End(netns=str(a.netns), ip=a.ip), [link.End(netns=str(b.netns), ip=b.ip)])
        proc, _ = link.start(*ends, delay_ms=1, loss=10, seconds=30)
        lost, unreachable = client.ask("echo", 5)
        stats = link.finish(proc)
        assert stats["dropped"] >= 1
        assert lost >= 1 and not unreachable  # resent, or arrived out of order
        assert proc_tcp_retransmitting(client.client.pid) is False  # all acknowledged
        net.cut(b)  # pod b's link down: nothing is acknowledged any more
        lost_after, unreachable = client.ask("push", 10)
        assert unreachable and lost_after > lost
        # what the launcher reads of a worker (another process): waiting out an RTO
        assert proc_tcp_retransmitting(client.client.pid) is True
    finally:
        client.close()


def test_loopback_connections_are_no_network() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    done = threading.Event()

    def echo() -> None:
        while data := peer.recv(65536):
            peer.sendall(data)
        done.set()

    threading.Thread(target=echo, daemon=True).start()
    try:
        conns = OwnConnections(relist_s=0.0)
        base = conns.loss()
        assert base is not None
        for _ in range(50):
            conn.sendall(b"y" * 50_000)
            got = 0
            while got < 50_000:
                got += len(conn.recv(65536))
        loss = conns.loss()
        assert loss is not None and loss.lost == {} and not loss.unreachable
        assert conn.fileno() >= 0 and peer.fileno() >= 0  # looked at, never closed
    finally:
        conn.close()
        done.wait(5)
        peer.close()
        listener.close()


def test_loss_since_counts_the_connections_open_at_both_readings_only() -> None:
    """A connection opened in between may count a resent SYN (a loaded listener's backlog):
    seen on loopback by a stuck rank after an in-process restart, which then waited 30 soft
    timeouts instead of one."""
    base = Loss({1: 5, 2: 7}, unreachable=False)
    assert Loss({1: 5, 2: 7}, False).since(base) == 0
    assert Loss({1: 6, 3: 2}, False).since(base) == 1
    assert Loss({1: 4}, False).since(base) == 0
