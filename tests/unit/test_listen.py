"""The stores and sockets the agent hosts listen on loopback for a single-node job (torch's
TCPStore alone would listen on every interface), on the node's own interface otherwise."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from unbroken.launcher import listen


def listening(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(addr_hex)
            if family == socket.AF_INET:
                raw = raw[::-1]
            else:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
            out.add(socket.inet_ntop(family, raw))
    return out


def test_bind_address_rules() -> None:
    assert listen.bind_address("127.0.0.1", single_node=True) == "127.0.0.1"
    assert listen.bind_address("localhost", single_node=True) == "127.0.0.1"
    assert listen.bind_address("127.0.0.1", single_node=False) == listen.ANY
    assert listen.bind_address("no-such-host.invalid", single_node=False) == listen.ANY


def test_a_hosted_store_listens_on_loopback_only() -> None:
    store = listen.listening_store(
        dist, "127.0.0.1", 0, bind="127.0.0.1", timeout=timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert listening(store.port) == {"127.0.0.1"}
    del client, store


def test_torch_alone_listens_everywhere() -> None:
    """Why listening_store exists: the same store made by torch listens on every interface."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    assert listening(store.port) & {"0.0.0.0", "::"}
    del store


def test_standalone_rendezvous_stores_listen_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.launcher import args as largs
    from unbroken.launcher.rendezvous import C10dRendezvous

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # restored afterwards
    spec, _, _ = largs.parse(["--standalone", "--nproc-per-node", "1", "train.py"])
    rdzv = C10dRendezvous(spec, node_addr="127.0.0.1", timeout_s=30, poll_s=0.05)
    try:
        assert listening(rdzv.job_store.port) == {"127.0.0.1"}
        info = rdzv.next_round()
        assert listening(info.master_port) == {"127.0.0.1"}
    finally:
        rdzv.close()


def test_metrics_listen_on_loopback_for_a_job_on_this_machine_alone() -> None:
    from unbroken.launcher import args as largs
    from unbroken.launcher import cli as lcli

    def host(*argv: str) -> str:
        spec, cfg, _ = largs.parse([*argv, "--nproc-per-node", "1", "train.py"])
        return lcli.metrics_host(spec, cfg)

    assert host("--standalone") == "127.0.0.1"
    assert host("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400") == "127.0.0.1"
    assert host("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:1") == "0.0.0.0"
    assert host("--standalone", "--ft-metrics-host", "0.0.0.0") == "0.0.0.0"


@pytest.mark.slow
def test_the_restart_store_server_listens_on_loopback_only() -> None:
    from unbroken.restart.store import StoreHost, bind_host, spawn_server

    assert bind_host("localhost", single_node=True) == "127.0.0.1"
    assert bind_host("127.0.0.1", single_node=False) == ""
    proc, port = spawn_server(timeout_s=60)
    host = StoreHost("127.0.0.1", port, server=proc)
    try:
        client = host.client(timeout_s=10)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert listening(port) == {"127.0.0.1"}
        del client
    finally:
        host.close()
    assert proc.returncode == 0


def test_malformed_registrations_in_the_store_are_ignored() -> None:
    from unbroken.restart import store_server

    class Store:
        def add(self, key: str, n: int) -> int:
            return 3

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [b"\xff\xfe", f"{socket.gethostname()}:notapid".encode(), b"elsewhere:1"]

    assert store_server._local_pids(Store()) == []
