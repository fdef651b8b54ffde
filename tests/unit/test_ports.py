"""A port handed to another process lies outside the ephemeral range, where an outgoing
connection cannot take it before the process binds it."""

from __future__ import annotations

import socket

from unbroken.ports import ephemeral_range, spare_port


def test_a_spare_port_is_free_and_below_the_ephemeral_range() -> None:
    eph = ephemeral_range()
    assert eph is not None and eph[0] > 10_000  # Linux's default is 32768-60999
    ports = {spare_port() for _ in range(20)}
    assert all(10_000 <= p < eph[0] for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_port_held_by_a_listener_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", spare_port()))
            s.listen(1)
            held.append(s)
        ports = [s.getsockname()[1] for s in held]
        assert len(set(ports)) == len(ports)
    finally:
        for s in held:
            s.close()
