"""Aborting a process group's transport: only the connections formed after the snapshot."""

from __future__ import annotations

import socket
import threading

from unbroken.restart.pg import Reaper, Transport


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


def test_close_shuts_down_new_connections_only() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    old_client, old_server = _pair(listener)
    keep_listener = socket.create_server(("127.0.0.1", 0))
    transport = Transport(keep_ports=[keep_listener.getsockname()[1]])
    new_client, new_server = _pair(listener)
    kept = socket.create_connection(keep_listener.getsockname())
    kept_peer, _ = keep_listener.accept()
    new_listener = socket.create_server(("127.0.0.1", 0))
    try:
        # new_client and new_server are both ours and new: 2 sockets; the kept one stays.
        assert transport.close() == 2
        assert new_client.recv(1) == b"" and new_server.recv(1) == b""
        old_client.sendall(b"x")
        assert old_server.recv(1) == b"x"
        kept.sendall(b"y")
        assert kept_peer.recv(1) == b"y"
        # The new listener still accepts (gloo aborts the process if its listener breaks).
        c = socket.create_connection(new_listener.getsockname())
        new_listener.accept()[0].close()
        c.close()
    finally:
        for s in (
            listener,
            old_client,
            old_server,
            keep_listener,
            new_client,
            new_server,
            kept,
            kept_peer,
            new_listener,
        ):
            s.close()


def test_close_unblocks_a_thread_blocked_in_recv() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    transport = Transport()
    client, server = _pair(listener)
    got = []
    t = threading.Thread(target=lambda: got.append(server.recv(1)), name="unbroken-test-recv")
    t.start()
    try:
        transport.close()
        t.join(5)
        assert not t.is_alive() and got == [b""]
    finally:
        for s in (listener, client, server):
            s.close()


def test_reaper_drops_and_calls_off_the_calling_thread() -> None:
    seen = []

    class Heavy:
        def __del__(self) -> None:
            seen.append(("del", threading.current_thread().name))

    reaper = Reaper()
    reaper.drop(Heavy())
    reaper.call(lambda: seen.append(("call", threading.current_thread().name)))
    reaper.close()
    assert seen == [("del", "unbroken-restart-reaper"), ("call", "unbroken-restart-reaper")]
