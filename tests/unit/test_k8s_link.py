"""The emulated cluster's degraded link: real packets between two pod namespaces, delayed and
dropped in user space, and the links whole again after (or when the forwarder is killed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unbroken.k8s.emulate import Cluster, EmulationConfig, link
from unbroken.k8s.emulate.net import NetnsNetwork, PodNet, netns_unavailable

netns = pytest.mark.skipif(netns_unavailable() is not None, reason=f"{netns_unavailable()}")

SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000))
s.listen()
print("listening", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := c.recv(65536):
    c.sendall(data)
"""
CLIENT = """
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], 9000))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for line in sys.stdin:
    rtts = []
    for _ in range(int(line)):
        t = time.perf_counter()
        c.sendall(b"x" * 100)
        got = 0
        while got < 100:
            got += len(c.recv(65536))
        rtts.append(time.perf_counter() - t)
    print(json.dumps(sorted(rtts)), flush=True)
"""


class Echo:
    """A TCP echo server in pod b and a client in pod a, over one connection."""

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

    def rtt_ms(self, n: int) -> float:
        """Median round trip of ``n`` small messages, in ms."""
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(f"{n}\n")
        self.client.stdin.flush()
        rtts = json.loads(self.client.stdout.readline())
        return rtts[len(rtts) // 2] * 1000

    def close(self) -> None:
        for p in (self.client, self.server):
            p.kill()
            p.wait()


@pytest.fixture
def pods() -> Iterator[tuple[PodNet, PodNet]]:
    net = NetnsNetwork()
    try:
        yield net.attach("a"), net.attach("b")
    finally:
        net.close()


def _links(ns: str | None) -> str:
    return (
        subprocess.run(["ip", "-n", str(ns), "-o", "link"], capture_output=True, text=True).stdout
        + subprocess.run(["ip", "-n", str(ns), "route"], capture_output=True, text=True).stdout
    )


@netns
def test_packets_are_delayed_each_way_then_the_link_is_whole_again(
    pods: tuple[PodNet, PodNet],
) -> None:
    a, b = pods
    echo = Echo(a, b)
    try:
        assert echo.rtt_ms(5) < 20
        ends = (link.End(netns=str(a.netns), ip=a.ip), [link.End(netns=str(b.netns), ip=b.ip)])
        proc, ready = link.start(*ends, delay_ms=30, loss=0, seconds=2.0)
        assert ready["until"] - ready["ts"] == pytest.approx(2.0)
        assert link.IFNAME in _links(a.netns) and link.IFNAME in _links(b.netns)
        assert echo.rtt_ms(5) >= 60  # 30 ms each way, the open connection rerouted
        stats = link.finish(proc, timeout_s=10)
        assert stats["forwarded"] >= 10 and stats["dropped"] == 0  # 5 messages, 5 replies
        assert echo.rtt_ms(5) < 20
        assert link.IFNAME not in _links(a.netns) and link.IFNAME not in _links(b.netns)
    finally:
        echo.close()


@netns
@pytest.mark.slow
def test_loss_drops_packets_and_tcp_resends_them(pods: tuple[PodNet, PodNet]) -> None:
    a, b = pods
    echo = Echo(a, b)
    try:
        ends = (link.End(netns=str(a.netns), ip=a.ip), [link.End(netns=str(b.netns), ip=b.ip)])
        proc, _ = link.start(*ends, delay_ms=1, loss=20, seconds=30)
        echo.rtt_ms(40)  # every message still comes back
        stats = link.finish(proc)  # ends the window early
        assert stats["dropped"] >= 3 and stats["forwarded"] >= 40
        assert link.IFNAME not in _links(a.netns)
    finally:
        echo.close()


@netns
def test_a_killed_forwarder_leaves_the_links_whole(pods: tuple[PodNet, PodNet]) -> None:
    a, b = pods
    echo = Echo(a, b)
    try:
        ends = (link.End(netns=str(a.netns), ip=a.ip), [link.End(netns=str(b.netns), ip=b.ip)])
        proc, _ = link.start(*ends, delay_ms=30, loss=0, seconds=60)
        assert echo.rtt_ms(3) >= 60
        proc.kill()
        proc.communicate()
        time.sleep(0.1)
        assert link.IFNAME not in _links(a.netns) and link.IFNAME not in _links(b.netns)
        assert echo.rtt_ms(3) < 20
    finally:
        echo.close()


@netns
def test_a_bad_end_fails_to_start_with_the_reason(pods: tuple[PodNet, PodNet]) -> None:
    a, _ = pods
    with pytest.raises(OSError, match="did not start.*no-such-ns"):
        link.start(
            link.End(netns=str(a.netns), ip=a.ip),
            [link.End(netns="no-such-ns", ip="10.9.9.9")],
            delay_ms=1,
            loss=0,
            seconds=1,
        )
    assert link.IFNAME not in _links(a.netns)


def test_loopback_pods_have_no_link_to_degrade(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, cfg=EmulationConfig(mode="loopback"))
    try:
        with pytest.raises(OSError, match="netns pods only, not in loopback mode"):
            cluster.degrade(None, [], delay_ms=1, loss=0, seconds=1, seed=0)  # type: ignore[arg-type]
    finally:
        cluster.close()
