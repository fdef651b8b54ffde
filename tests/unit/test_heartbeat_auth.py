"""Heartbeats are authenticated: the agent's socket counts only datagrams signed with the job's
secret (HMAC-SHA256, handed to workers as UNBROKEN_HEARTBEAT_KEY); forged, unsigned and
malformed datagrams are dropped and counted, and no datagram makes ``drain`` raise."""

from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken import env as uenv
from unbroken.launcher import client
from unbroken.launcher.monitor import HeartbeatServer, parse_datagram

KEY = b"k" * 32
GOOD = {"v": 1, "rank": 0, "lr": 0, "pid": 1, "round": 0, "step": 3, "committed": None}


def _payload(msg: dict) -> bytes:
    return json.dumps(msg).encode()


def _drain(server: HeartbeatServer, n: int) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(got) + server.rejected < n:
        got += server.drain()
        time.sleep(0.01)
    return got


def test_only_datagrams_signed_with_the_job_key_count() -> None:
    server = HeartbeatServer(key=KEY)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    host, port = server.addr.rsplit(":", 1)
    try:
        for data in [
            _payload(GOOD),  # unsigned: what any local process could send
            client.sign(b"x" * 32, _payload(GOOD)),  # another job's key
            client.sign(KEY, _payload(GOOD)).replace(b"3", b"9"),  # tampered after signing
            client.sign(KEY, b"[" * 4000),  # signed but not a heartbeat
            client.sign(KEY, _payload({**GOOD, "lr": "0"})),
            b"\xff" * 100,
            client.sign(KEY, _payload(GOOD)),  # the one good datagram
        ]:
            sock.sendto(data, (host, int(port)))
        got = _drain(server, 7)
        assert got == [GOOD] and server.rejected == 6
    finally:
        sock.close()
        server.close()


def test_a_worker_signs_with_the_key_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    server = HeartbeatServer(key=KEY)
    try:
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_ADDR, server.addr)
        monkeypatch.setenv(uenv.UNBROKEN_HEARTBEAT_KEY, KEY.hex())
        client.reset()
        client.heartbeat(5)
        (msg,) = _drain(server, 1)
        assert msg["step"] == 5 and server.rejected == 0
    finally:
        client.reset()
        server.close()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=200), st.none() | st.just(KEY))
def test_parse_datagram_never_raises(data: bytes, key: bytes | None) -> None:
    msg = parse_datagram(data, key)
    assert msg is None or isinstance(msg["lr"], int)
    assert parse_datagram(client.sign(KEY, data), KEY) == parse_datagram(data, None)
