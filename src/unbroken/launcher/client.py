"""The worker side of hang detection: ``heartbeat(step)`` tells the node's agent "still going".

One UDP datagram on the loopback to ``UNBROKEN_HEARTBEAT_ADDR``, signed with the job's secret
``UNBROKEN_HEARTBEAT_KEY`` (HMAC-SHA256) when the agent gave one; it never blocks and never
raises. Outside ``unbroken-run`` (no address in the environment) a call is a no-op costing a
comparison. Call it once per training step, after the step completes (the
reference script does so right after its ledger step record); pass ``committed_step`` when a
checkpoint of that step is durable, so the agent's no-progress guard can see it.

A worker that has never called ``heartbeat`` is not watched for hangs until the job has shown it
heartbeats (see ``monitor``). Calls for the same step closer together than
``UNBROKEN_HEARTBEAT_INTERVAL_S`` are dropped, and a new step is sent at most every
``STEP_GAP_S``. ``waiting(why)`` is the in-process watchdog's word that a silent worker waits
on a slow network, not hung (see ``monitor``). Safe after ``fork``: the state is per process.

Never imports torch. Imports of ours: ``unbroken.env``.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import time
from typing import Any

from unbroken import env as uenv

# Datagram fields (kept short: this runs on the training thread every step).
VERSION = 1

STEP_GAP_S = 0.05
"""A new step is told at most this often (a signed datagram is the dearest of a step's calls,
so a short step does not send one every step); a new committed step or the last step is told
at once."""


WAIT_CHARS = 160
"""The longest reason a ``waiting`` datagram carries."""


def sign(key: bytes, payload: bytes) -> bytes:
    """A signed datagram: the hex HMAC-SHA256 of ``payload`` under ``key``, a space, ``payload``."""
    return hmac.digest(key, payload, "sha256").hex().encode() + b" " + payload


class _Client:
    def __init__(
        self,
        addr: tuple[str, int],
        *,
        rank: int,
        local_rank: int,
        round_: int,
        interval_s: float,
        key: bytes | None = None,
    ) -> None:
        self.addr = addr
        self.key = key
        self.rank = rank
        self.local_rank = local_rank
        self.round = round_
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.last_sent = float("-inf")
        self.last_step: int | None = None
        self.newest_step: int | None = None
        self.last_committed: int | None = None
        self.finishing = False
        self.last_wait = float("-inf")

    def send(self, step: int | None, committed_step: int | None, finishing: bool = False) -> None:
        if step is None:  # "alive": tell the newest step, which a rate-limited call may not have
            step = self.newest_step
        else:
            self.newest_step = step
        now = time.monotonic()
        since = now - self.last_sent
        urgent = (
            committed_step is not None and committed_step != self.last_committed
        ) or finishing != self.finishing
        stepped = step is not None and step != self.last_step
        if not urgent and since < (
            min(self.interval_s, STEP_GAP_S) if stepped else self.interval_s
        ):
            return
        if not self._send(step, committed_step, **({"fin": True} if finishing else {})):
            return
        self.last_sent = now
        self.finishing = finishing
        if step is not None:
            self.last_step = step
        if committed_step is not None:
            self.last_committed = committed_step

    def send_wait(self, why: str) -> None:
        now = time.monotonic()
        if now - self.last_wait < self.interval_s / 2:
            return
        if self._send(None, None, wait=why[:WAIT_CHARS]):
            self.last_wait = now

    def _send(self, step: int | None, committed: int | None, **extra: Any) -> bool:
        """One datagram (signed when there is a key); False when it could not be sent."""
        msg = {
            "v": VERSION,
            "rank": self.rank,
            "lr": self.local_rank,
            "pid": self.pid,
            "round": self.round,
            "step": step,
            "committed": committed,
            "ts": time.time(),
            **extra,
        }
        try:
            payload = json.dumps(msg, separators=(",", ":")).encode()
            self.sock.sendto(payload if self.key is None else sign(self.key, payload), self.addr)
        except OSError:  # agent gone, buffer full, ICMP refusal: the agent will notice by itself
            return False
        return True


_client: _Client | None = None
_known = False  # _client is this process's (None: no agent); a fork forgets it


def _forget() -> None:
    global _known
    _known = False


os.register_at_fork(after_in_child=_forget)


def _get() -> _Client | None:
    global _client, _known
    if _known:
        return _client
    if _client is not None:  # the parent's (a fork): this process's copy of its socket
        _client.sock.close()
        _client = None
    _known = True
    try:
        target = uenv.HeartbeatEnv.from_environ()
        if target is None:
            return None
        _client = _Client(
            (target.host, target.port),
            rank=target.rank,
            local_rank=target.local_rank,
            round_=target.round,
            interval_s=target.interval_s,
            key=target.key,
        )
    except (ValueError, OSError):
        _client = None
    return _client


def heartbeat(
    step: int | None = None, *, committed_step: int | None = None, finishing: bool = False
) -> None:
    """Tell the node agent this worker is alive (and at ``step``); cheap, never raises.

    Call after a training step completes. Without an agent (not under ``unbroken-run``) it
    does nothing.

    Args:
        step: The step just completed (None: alive, no step).
        committed_step: The newest step whose checkpoint is durable, if any.
        finishing: The last step is done: the wait for the final checkpoint and the exit then
            get the initial timeout, not the steady one (which is sized for steps).
    """
    client = _get()
    if client is not None:
        client.send(step, committed_step, finishing)


def waiting(why: str) -> None:
    """Tell the node agent this worker is silent because it waits on a slow network, not hung:
    its in-process watchdog sees the collective's data move (``restart.watchdog``: bytes
    acknowledged, segments lost and resent), which the agent cannot see from /proc on the
    receiving side. The agent then gives it time as it would a worker it sees sending
    (``slowness``), up to the same limit; the datagram is no heartbeat (the silence goes on).
    Sent at most twice a heartbeat interval; cheap, never raises; a no-op without an agent.

    Args:
        why: What the watchdog saw, for the agent's log (cut to ``WAIT_CHARS``).
    """
    client = _get()
    if client is not None:
        client.send_wait(why)


def reset() -> None:
    """Forget the cached client (tests; the environment changed)."""
    global _client, _known
    if _client is not None:
        _client.sock.close()
    _client, _known = None, False
