"""Peer memory: every rank's snapshots reachable from every node, and a replica on another one.

The memory tier (``memory``) survives a process: the node agent's keeper holds each worker's
arena. It does not survive the node, and after a node is lost the rendezvous often gives the
surviving nodes other ranks, so a rank's snapshots may lie on another node. Two parts fix both:

- the **service** (``PeerService``), one per node, run by the ``unbroken-run`` agent on a TCP
  port of the node's address: it holds *replicas* put by the workers of the previous node in
  the round (the two newest snapshots of each of their ranks, each a region of a 2-region
  ring), and serves them and the arenas its own keeper holds (``local``), to whoever asks;
- the **replicator** (``Replicator``), one per Checkpointer of a multi-node job: every sealed
  snapshot is offered to a background thread, which sends the newest one to the next node's
  service (node g -> node g+1 mod n, so that one node's loss never takes both copies), newest
  wins: a snapshot sealed while the previous one is still sending replaces it in the queue.

A restore with nothing in local memory (``fetch``) asks every node's service which steps it
holds for this rank (``info``: its keeper's arena, the original, and its replica), and copies
the one with the newest step into a fresh arena (``get``); the memory tier then checks every
tensor's digest, as for an arena a dead process wrote, and falls back to older steps, then to
disk. A replica torn while sending never counts: the sender reads the region's header again
after the bytes and sends "abort" when it changed (the region was reused); the service writes
the region's header only on "commit", after every byte.

Wire format (TCP): a request is a frame (4-byte big-endian length, then JSON with ``op``, ``key``
and the service's ``token``), for ``put`` followed by the region's bytes and one byte, 1
(commit) or 0 (abort); every reply is a frame, for ``get`` followed by ``nbytes`` bytes. The
token (made by the service, handed to workers with its address as ``host:port#token``) keeps
other jobs on the cluster from reading or overwriting this one's state; the rendezvous store
that publishes it is as trusted as the store itself.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.checkpoint.config import split_peer
from unbroken.checkpoint.staging import ring_format
from unbroken.checkpoint.staging.arena import Arena

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!I")
_MAX_FRAME = 1 << 20
_TIMEOUT_S = 10.0
_REPLICA_REGIONS = 2


@dataclass(frozen=True)
class Peer:
    """A node's service: where it listens and the token it wants."""

    host: str
    port: int
    token: str

    @classmethod
    def parse(cls, text: str) -> Peer:
        return cls(*split_peer(text))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}#{self.token}"


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _recv(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_FRAME.size)
    _recv_exact(sock, memoryview(head))
    (n,) = _FRAME.unpack(head)
    if n > _MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes (at most {_MAX_FRAME})")
    data = bytearray(n)
    _recv_exact(sock, memoryview(data))
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ValueError("a frame that is not a JSON object")
    return msg


def _seq(held: tuple[int, int] | None) -> int:
    return -1 if held is None else held[1]


@dataclass
class _Replica:
    arena: Arena
    ring: ring_format.Ring
    round: int


class PeerService:
    """This node's service on ``bind`` (port 0: any free one), reached by peers as ``host``.
    ``local(key)`` gives a descriptor of the arena the node's keeper holds under ``key`` (the
    caller's to close), or None."""

    def __init__(
        self, *, host: str, bind: str, local: Callable[[str], int | None] | None = None
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self._sock.listen(64)
        self.peer = Peer(host, self._sock.getsockname()[1], secrets.token_hex(16))
        self.local = local
        """Where the node's keeper arenas come from (settable once the keeper exists)."""
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        self._round = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="unbroken-peers", daemon=True)
        self._thread.start()

    def begin_round(self, round_: int) -> None:
        """A new round: replicas not put in this or the previous round are dropped (their
        ranks belong to other nodes now, and got their state in that round)."""
        with self._lock:
            self._round = round_
            old = [k for k, r in self._replicas.items() if r.round < round_ - 1]
            dropped = [self._replicas.pop(k) for k in old]
        for r in dropped:
            r.arena.close()

    def held(self) -> dict[str, list[int]]:
        """Key -> steps of every replica held now (newest first)."""
        with self._lock:
            return {k: ring_format.held_steps(r.arena) for k, r in self._replicas.items()}

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="unbroken-peer", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_TIMEOUT_S * 6)
            try:
                while not self._closed:
                    try:
                        msg = _recv(conn)
                    except ConnectionError:
                        return  # the client is done
                    if not hmac.compare_digest(str(msg.get("token", "")), self.peer.token):
                        _send(conn, {"ok": False, "error": "bad token"})
                        return
                    op, key = msg.get("op"), str(msg.get("key", ""))
                    if op == "put":
                        self._put(conn, key, msg)
                    elif op == "info":
                        _send(conn, {"ok": True, "sources": self._info(key)})
                    elif op == "get":
                        self._get(conn, key, str(msg.get("from", "")))
                    else:
                        _send(conn, {"ok": False, "error": f"unknown op {op!r}"})
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("peer service: a bad request: %s", e)

    def _put(self, conn: socket.socket, key: str, msg: dict[str, Any]) -> None:
        ring = ring_format.Ring(_REPLICA_REGIONS, int(msg["data_bytes"]), int(msg["meta_cap"]))
        if ring.stride != int(msg["stride"]) or ring.meta_cap < ring_format.PAGE:
            raise ValueError(f"a put of stride {msg['stride']} for a ring of {ring.stride}")
        with self._lock:
            rep = self._replicas.get(key)
            if rep is None or rep.ring != ring:
                arena = Arena(name="unbroken-replica")
                arena.ensure(ring.total, touch=0)  # the bytes come from the socket
                ring_format.write_ring(arena, ring)
                old, rep = rep, _Replica(arena, ring, self._round)
                self._replicas[key] = rep
                if old is not None:
                    old.arena.close()
            rep.round = self._round
        # One sender per key; a reader meanwhile sees the other region whole, and this one
        # empty or (torn, if it read before the clear) failing its digests.
        held = [ring_format.sealed_as(rep.arena, ring, r) for r in range(ring.regions)]
        region = min(range(ring.regions), key=lambda r: _seq(held[r]))
        ring_format.clear(rep.arena, ring, region)
        base = ring.base(region)
        head = bytearray(ring_format.PAGE)
        _recv_exact(conn, memoryview(head))
        with rep.arena.window(base + ring_format.PAGE, ring.stride - ring_format.PAGE) as body:
            _recv_exact(conn, body)
        verdict = bytearray(1)
        _recv_exact(conn, memoryview(verdict))
        if verdict[0] == 1:
            rep.arena.write(base, bytes(head))  # the header last: now it is a snapshot
        _send(conn, {"ok": True, "committed": verdict[0] == 1})

    def _open(self, key: str, source: str) -> tuple[Arena | None, bool]:
        """(the arena for ``source`` of ``key``, whether the caller must close it)."""
        if source == "replica":
            with self._lock:
                rep = self._replicas.get(key)
            return (rep.arena if rep else None), False
        fd = self.local(key) if self.local is not None else None
        if fd is None:
            return None, False
        return Arena.adopt(fd), True

    def _info(self, key: str) -> dict[str, list[int]]:
        out = {}
        for source in ("keeper", "replica"):
            arena, mine = self._open(key, source)
            if arena is None:
                continue
            try:
                steps = ring_format.held_steps(arena)
            finally:
                if mine:
                    arena.close()
            if steps:
                out[source] = steps
        return out

    def _get(self, conn: socket.socket, key: str, source: str) -> None:
        arena, mine = self._open(key, source)
        if arena is None:
            _send(conn, {"ok": False, "error": f"no {source} for {key!r}"})
            return
        try:
            nbytes = _used(arena)
            _send(conn, {"ok": True, "nbytes": nbytes, "size": arena.size})
            with arena.window(0, nbytes) as used:
                conn.sendall(used)
        finally:
            if mine:
                arena.close()

    def close(self) -> None:
        """Stop serving and free every replica. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            reps, self._replicas = list(self._replicas.values()), {}
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5.0)
        for r in reps:
            r.arena.close()


def _used(arena: Arena) -> int:
    """Bytes of ``arena`` up to the end of its last sealed region (what a fetch needs: a lean
    arena's spare region is sent only when it holds a snapshot, and never read into memory)."""
    ring = ring_format.read_ring(arena)
    if ring is None:
        return arena.size
    sealed = [r for r in range(ring.regions) if ring_format.sealed_as(arena, ring, r) is not None]
    return ring.base(max(sealed) + 1) if sealed else ring_format.PAGE


def _connect(peer: Peer, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((peer.host, peer.port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def fetch(
    peers: list[Peer], key: str, *, timeout_s: float = 2.0
) -> tuple[Arena | None, str | None]:
    """This rank's newest snapshots from the node that holds the newest step (its keeper's
    original preferred over a replica of the same step), in a fresh arena (digests not checked
    yet), and where it came from; (None, None) when no service holds any."""
    best: tuple[int, int, Peer, str] | None = None
    for peer in peers:
        try:
            with _connect(peer, timeout_s) as sock:
                _send(sock, {"op": "info", "key": key, "token": peer.token})
                reply = _recv(sock)
        except (OSError, ValueError) as e:
            logger.warning("peer %s:%d unreachable: %s", peer.host, peer.port, e)
            continue
        for source, steps in (reply.get("sources") or {}).items():
            rank = (max(steps), 1 if source == "keeper" else 0)
            if steps and (best is None or rank > best[:2]):
                best = (*rank, peer, source)
    if best is None:
        return None, None
    _, _, peer, source = best
    arena = Arena(name="unbroken-ckpt")
    try:
        with _connect(peer, max(timeout_s, _TIMEOUT_S)) as sock:
            _send(sock, {"op": "get", "key": key, "from": source, "token": peer.token})
            reply = _recv(sock)
            if not reply.get("ok"):
                raise ValueError(reply.get("error", "refused"))
            nbytes = int(reply["nbytes"])
            arena.ensure(max(nbytes, int(reply.get("size", nbytes))), touch=nbytes)
            with arena.window(0, nbytes) as used:
                _recv_exact(sock, used)
    except (OSError, ValueError, KeyError) as e:
        logger.warning("could not fetch %s from peer %s:%d: %s", key, peer.host, peer.port, e)
        arena.close()
        return None, None
    return arena, f"{source} of {peer.host}:{peer.port}"


class Replicator:
    """Sends each rank's newest sealed snapshot to ``peer`` (the next node's service), from a
    background thread; ``offer`` is called by the stager as each snapshot is sealed."""

    def __init__(self, peer: Peer, key: str) -> None:
        self.peer = peer
        self.key = key
        self.sent = 0
        """Snapshots the service committed."""
        self.torn = 0
        """Snapshots aborted because their region was reused while sending."""
        self._pending: tuple[Arena, ring_format.Ring, int, int] | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._sock: socket.socket | None = None
        self._warned = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="unbroken-replicator", daemon=True)
        self._thread.start()

    def offer(self, arena: Arena, ring: ring_format.Ring, region: int, seq: int) -> None:
        with self._cv:
            self._pending = (arena, ring, region, seq)
            self._cv.notify()

    def idle(self, timeout_s: float) -> bool:
        """Wait until nothing is pending or being sent; True when so (tests, benchmarks)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                job, self._pending = self._pending, None
                self._busy = True
            assert job is not None
            try:
                self._send(*job)
            except (OSError, ValueError) as e:
                if not self._warned:
                    logger.warning("replica to %s:%d failed: %s", self.peer.host, self.peer.port, e)
                    self._warned = True
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _send(self, arena: Arena, ring: ring_format.Ring, region: int, seq: int) -> None:
        before = ring_format.sealed_as(arena, ring, region)
        if before is None or before[1] != seq:
            return  # reused already: a newer one is or will be offered
        if self._sock is None:
            self._sock = _connect(self.peer, _TIMEOUT_S)
        sock = self._sock
        msg = {
            "op": "put",
            "key": self.key,
            "token": self.peer.token,
            "stride": ring.stride,
            "data_bytes": ring.data_bytes,
            "meta_cap": ring.meta_cap,
        }
        _send(sock, msg)
        with arena.window(ring.base(region), ring.stride) as region_bytes:
            sock.sendall(region_bytes)
        ok = ring_format.sealed_as(arena, ring, region) == before
        sock.sendall(b"\x01" if ok else b"\x00")
        reply = _recv(sock)
        if not reply.get("ok"):
            raise ValueError(reply.get("error", "refused"))
        if ok:
            self.sent += 1
        else:
            self.torn += 1

    def close(self) -> None:
        """Stop sending (what is pending is dropped). Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=_TIMEOUT_S)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
