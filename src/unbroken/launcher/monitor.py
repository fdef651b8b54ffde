"""The agent side of hang detection: a UDP heartbeat socket and the per-rank deadlines.

``HeartbeatServer`` owns the socket (127.0.0.1, a free port) for the whole job; the agent's
event loop selects on it. ``HeartbeatTracker`` is pure bookkeeping over a monotonic clock, so
tests drive it with scripted heartbeats and times:

- a worker that has sent a heartbeat in this round must send the next within the steady
  timeout;
- a worker that has not sent one yet must do so within the initial timeout of its start, but
  only once the job has shown that it heartbeats (some worker of it sent one, in any round or
  in an earlier run of the agent on this run directory). An unmodified torchrun script that
  never calls ``heartbeat()`` is therefore never killed for silence;
- with automatic timeouts (the default), both timeouts shrink to what the job has shown it
  needs (``calibrate``; never above the configured value); the observations persist in
  ``<run_dir>/launcher/heartbeats.json`` across restarts;
- a worker "finishing" (past its last step, or restarting in-process) gets the configured
  initial timeout until its next heartbeat without that flag;
- a silent worker that computes or sends is slow, not hung: its suspects get more time
  (``slowness``: the rules, what they read of /proc, their limits); so is one whose own
  in-process watchdog says it waits on a slow network (a ``waiting`` datagram: no heartbeat,
  its silence goes on).

Datagrams from an earlier round or another pid are ignored, and so are datagrams not signed
with the job's secret (HMAC-SHA256; see ``parse_datagram``) or not shaped like a heartbeat.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.launcher import calibrate
from unbroken.launcher.client import WAIT_CHARS
from unbroken.launcher.slowness import VOUCH_FRESH, ByteCount, RunClock, slow_not_hung
from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)

STATE_FILE = "heartbeats.json"

_INT_FIELDS = ("lr", "rank", "pid", "round")
_OPT_INT_FIELDS = ("step", "committed")
_MAC_HEX = 64  # hex digits of an HMAC-SHA256


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_datagram(data: bytes, key: bytes | None) -> dict[str, Any] | None:
    """A heartbeat's fields, or None for a datagram that is not one of this job's.

    With ``key``, a datagram is ``<hex HMAC-SHA256 of the payload> <payload>`` (``client.sign``)
    and one without a valid MAC is rejected; without, the payload alone. The payload is a JSON
    object with integer ``lr``/``rank``/``pid``/``round`` and integer-or-null ``step`` and
    ``committed``. Never raises.
    """
    if key is not None:
        mac, payload = data[:_MAC_HEX], data[_MAC_HEX + 1 :]
        want = hmac.new(key, payload, hashlib.sha256).hexdigest().encode()
        if data[_MAC_HEX : _MAC_HEX + 1] != b" " or not hmac.compare_digest(mac, want):
            return None
        data = payload
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(msg, dict):
        return None
    if not all(_is_int(msg.get(k)) for k in _INT_FIELDS):
        return None
    if not all(msg.get(k) is None or _is_int(msg.get(k)) for k in _OPT_INT_FIELDS):
        return None
    return msg


class HeartbeatServer:
    """The agent's UDP socket; ``drain()`` returns every pending, well-formed datagram.

    It listens on the loopback (workers are on the agent's node). With ``key`` (the agent
    makes one per job: ``new_key()``), only datagrams signed with it count; the others are
    dropped and counted in ``rejected`` (logged once), never an error.
    """

    def __init__(self, host: str = "127.0.0.1", *, key: bytes | None = None) -> None:
        self.key = key
        self.rejected = 0
        """Datagrams dropped: malformed, unsigned or signed with another key."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        host, port = self.sock.getsockname()[:2]
        self.addr = f"{host}:{port}"

    @staticmethod
    def new_key() -> bytes:
        """A fresh per-job heartbeat secret."""
        return secrets.token_bytes(32)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return out
            msg = parse_datagram(data, self.key)
            if msg is not None:
                out.append(msg)
                continue
            self.rejected += 1
            log = logger.warning if self.rejected == 1 else logger.debug
            log(
                "ignored a heartbeat datagram that is not this job's (malformed or not signed "
                "with its key; %d so far)",
                self.rejected,
            )

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True, kw_only=True)
class Hang:
    """A worker past its heartbeat deadline."""

    local_rank: int
    rank: int
    pid: int | None
    silent_s: float
    """Seconds since its last heartbeat (or its start, before the first)."""
    timeout_s: float
    """The timeout it exceeded."""
    runnable: float | None = None
    """Its threads' time running or runnable per second over the last stretch of that silence
    (cores), when measured."""
    sending: float | None = None
    """Bytes a second it wrote over that stretch, when measured."""
    retransmitting: bool | None = None
    """A connection of it to another host waits out a TCP retransmission timeout, when
    measured."""
    vouched: str | None = None
    """What its own in-process watchdog told lately (``client.waiting``): it waits on a slow
    network, not hung."""
    phase: str
    """"initial" (no heartbeat yet this round), "steady", or "finishing" (past the last step:
    the initial timeout applies)."""
    last_step: int | None


@dataclass
class _Worker:
    rank: int
    pid: int | None
    start: float
    first: float | None = None
    last: float | None = None
    last_step: int | None = None
    finishing: bool = False
    suspect: bool = False
    """Within half a timeout of its deadline since its last heartbeat."""
    mark: tuple[float, float] | None = None
    """(time, runnable seconds) when it became a suspect or its deadline was last extended."""
    sent_mark: tuple[float, int] | None = None
    """(time, bytes written) then."""
    extended_to: float | None = None
    """A deadline moved on because the node was computing."""
    vouched: tuple[float, str] | None = None
    """(time, why) of its watchdog's last ``waiting`` datagram."""


@dataclass
class Observed:
    """What the tracker has learned about this job's heartbeats (persisted)."""

    job_heartbeats: bool = False
    steady_gap_max_s: float = 0.0
    steady_samples: int = 0
    initial_max_s: float = 0.0
    initial_samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Observed:
        try:
            raw = json.loads(path.read_text())
            return cls(
                job_heartbeats=bool(raw.get("job_heartbeats", False)),
                steady_gap_max_s=float(raw.get("steady_gap_max_s", 0.0)),
                steady_samples=int(raw.get("steady_samples", 0)),
                initial_max_s=float(raw.get("initial_max_s", 0.0)),
                initial_samples=int(raw.get("initial_samples", 0)),
            )
        except (OSError, ValueError, AttributeError):
            return cls()

    def save(self, path: Path) -> None:
        """Merge with what is on disk (another agent may share the run dir) and replace it."""
        disk = Observed.load(path)
        merged = {
            "job_heartbeats": self.job_heartbeats or disk.job_heartbeats,
            "steady_gap_max_s": max(self.steady_gap_max_s, disk.steady_gap_max_s),
            "steady_samples": max(self.steady_samples, disk.steady_samples),
            "initial_max_s": max(self.initial_max_s, disk.initial_max_s),
            "initial_samples": max(self.initial_samples, disk.initial_samples),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(merged, indent=1))
        except OSError:
            logger.warning("could not persist heartbeat observations to %s", path)


class HeartbeatTracker:
    """Per-round heartbeat deadlines of this node's workers; times are monotonic seconds."""

    def __init__(
        self,
        *,
        enabled: bool,
        initial_timeout_s: float,
        steady_timeout_s: float,
        heartbeat_interval_s: float,
        auto_timeouts: bool = False,
        auto_timeout_factor: float = 16.0,
        observed: Observed | None = None,
        on_change: calibrate.OnChange | None = None,
        runnable_s: RunClock | None = None,
        sent_bytes: ByteCount | None = None,
        retransmitting: Callable[[int], bool | None] | None = None,
    ) -> None:
        """``on_change(name, value, previous)`` is told each move of an automatic timeout;
        ``runnable_s(pid)`` (``proc_runnable_s``) and ``sent_bytes(pid)`` (``proc_sent_bytes``)
        tell a slow worker from a hung one, and ``retransmitting(pid)``
        (``proc_tcp_retransmitting``) one whose link loses packets (None: that test is off)."""
        self.enabled = enabled
        self.initial_timeout_s = initial_timeout_s
        self.steady_timeout_s = steady_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.auto_timeouts = auto_timeouts
        self.auto_timeout_factor = auto_timeout_factor
        self.observed = observed or Observed()
        self.runnable_s = runnable_s
        self.sent_bytes = sent_bytes
        self.retransmitting = retransmitting
        self.round = -1
        self.workers: dict[int, _Worker] = {}
        self.best_step: int | None = None
        self.best_committed: int | None = None
        self._initial = calibrate.InEffect("initial_timeout_s", initial_timeout_s, on_change)
        self._steady = calibrate.InEffect("steady_timeout_s", steady_timeout_s, on_change)
        self._calibrate()

    # --- timeouts ----------------------------------------------------------------------------
    def _calibrate(self) -> None:
        if not (self.enabled and self.auto_timeouts):
            return
        o, f, i = self.observed, self.auto_timeout_factor, self.heartbeat_interval_s
        self._initial.offer(
            calibrate.initial_s(
                o.initial_max_s,
                o.initial_samples,
                configured=self.initial_timeout_s,
                factor=f,
                interval_s=i,
            )
        )
        self._steady.offer(
            calibrate.steady_s(
                o.steady_gap_max_s,
                o.steady_samples,
                configured=self.steady_timeout_s,
                factor=f,
                interval_s=i,
            )
        )

    def effective_initial_s(self) -> float:
        return self._initial.value

    def effective_steady_s(self) -> float:
        return self._steady.value

    # --- rounds ------------------------------------------------------------------------------
    def begin_round(
        self, round_: int, workers: Mapping[int, tuple[int, int | None]], now: float
    ) -> None:
        """Start watching ``{local_rank: (rank, pid)}`` of round ``round_``, started at ``now``."""
        self.round = round_
        self.workers = {lr: _Worker(rank=r, pid=pid, start=now) for lr, (r, pid) in workers.items()}

    def forget(self, local_rank: int) -> None:
        """Stop watching a worker (it exited)."""
        self.workers.pop(local_rank, None)

    def record(self, msg: dict[str, Any], now: float) -> bool:
        """Account one datagram; True when it is the first of its worker in this round."""
        w = self.workers.get(int(msg.get("lr", -1)))
        if (
            w is None
            or msg.get("round") != self.round
            or (w.pid is not None and msg.get("pid") != w.pid)
        ):
            return False
        why = msg.get("wait")
        if why is not None:  # the worker's word that it waits on the network: no heartbeat
            w.vouched = (now, str(why)[:WAIT_CHARS])
            return False
        first = w.first is None
        fin = msg.get("fin") is True
        if first:
            w.first = now
            self.observed.job_heartbeats = True
            self.observed.initial_max_s = max(self.observed.initial_max_s, now - w.start)
            self.observed.initial_samples += 1
            self._calibrate()
        elif w.last is not None and not w.finishing and not fin:
            # A gap that ends in "finishing" (a restart in-process, the last save) is no step.
            self.observed.steady_gap_max_s = max(self.observed.steady_gap_max_s, now - w.last)
            self.observed.steady_samples += 1
            self._calibrate()
        w.last = now
        w.finishing = fin
        w.suspect, w.mark, w.sent_mark, w.extended_to = False, None, None, None
        step, committed = msg.get("step"), msg.get("committed")
        if isinstance(step, int):
            w.last_step = step
            self.best_step = step if self.best_step is None else max(self.best_step, step)
        if isinstance(committed, int):
            self.best_committed = (
                committed if self.best_committed is None else max(self.best_committed, committed)
            )
        return first

    def all_heartbeated(self) -> bool:
        return bool(self.workers) and all(w.first is not None for w in self.workers.values())

    @property
    def progress(self) -> int | None:
        """The furthest the job got: the best step or committed step seen, else None (the job
        reports none). A step counts even before it is committed: with the memory tier a
        restart resumes from the newest snapshot, not the newest commit, so a job whose
        restarts each get it further is progressing (the guard is for restarts that do not)."""
        seen = [s for s in (self.best_step, self.best_committed) if s is not None]
        return max(seen) if seen else None

    # --- deadlines ---------------------------------------------------------------------------
    def _deadline(self, w: _Worker) -> tuple[float, float, str] | None:
        if w.last is not None and w.finishing:
            t, phase = self.initial_timeout_s, "finishing"
        elif w.last is not None:
            t, phase = self.effective_steady_s(), "steady"
        elif self.observed.job_heartbeats:
            t, phase = self.effective_initial_s(), "initial"
        else:
            return None
        since = w.last if w.last is not None else w.start
        return max(since + t, w.extended_to or 0.0), t, phase

    def _mark(self, w: _Worker, now: float) -> tuple[float, float] | None:
        got = None if self.runnable_s is None or w.pid is None else self.runnable_s(w.pid)
        return None if got is None else (now, got)

    def _sent_mark(self, w: _Worker, now: float) -> tuple[float, int] | None:
        got = None if self.sent_bytes is None or w.pid is None else self.sent_bytes(w.pid)
        return None if got is None else (now, got)

    def _sending(self, w: _Worker, now: float) -> float | None:
        """Bytes a second ``w`` wrote since its mark (None: not measured, or too short)."""
        new = self._sent_mark(w, now)
        if (
            w.sent_mark is None
            or new is None
            or new[0] - w.sent_mark[0] < self.heartbeat_interval_s
        ):
            return None
        return max(0, new[1] - w.sent_mark[1]) / (new[0] - w.sent_mark[0])

    def _cores(self, w: _Worker, now: float) -> float | None:
        """Cores ``w`` ran on or waited for since its mark (None: not measured, or too short)."""
        new = self._mark(w, now)
        if w.mark is None or new is None or new[0] - w.mark[0] < self.heartbeat_interval_s:
            return None
        return max(0.0, new[1] - w.mark[1]) / (new[0] - w.mark[0])  # < 0: a thread ended

    def _vouched(self, w: _Worker, now: float) -> str | None:
        """Why ``w``'s watchdog said it waits on the network, if it said so lately (it says
        so twice a heartbeat interval while it does)."""
        if w.vouched is None or now - w.vouched[0] > VOUCH_FRESH * self.heartbeat_interval_s:
            return None
        return w.vouched[1]

    def next_deadline(self) -> float | None:
        """The earliest monotonic time at which some worker becomes overdue, if any."""
        if not self.enabled:
            return None
        times = [
            d[0]
            if w.suspect or (self.runnable_s is None and self.sent_bytes is None)
            else d[0] - d[1] / 2
            for w in self.workers.values()
            if (d := self._deadline(w)) is not None
        ]  # a worker's runnable time is measured from the moment it becomes a suspect
        return min(times, default=None)

    def overdue(self, now: float) -> list[Hang]:
        """Workers past their deadline, plus those within half a timeout of it (co-suspects:
        in a collective hang every rank falls silent at once); the longest-silent first. Empty
        while no worker is past its deadline, or while a suspect computes (``_computing``)."""
        if not self.enabled:
            return []
        suspects, late = [], False
        for lr, w in self.workers.items():
            d = self._deadline(w)
            if d is None or now < d[0] - d[1] / 2:
                continue
            if not w.suspect:
                w.suspect, w.mark, w.sent_mark = True, self._mark(w, now), self._sent_mark(w, now)
            late = late or now >= d[0]
            suspects.append((lr, w, d))
        if not late:
            return []  # /proc is read only once someone is late
        out = [
            Hang(
                local_rank=lr,
                rank=w.rank,
                pid=w.pid,
                silent_s=now - (w.last if w.last is not None else w.start),
                timeout_s=d[1],
                phase=d[2],
                last_step=w.last_step,
                runnable=self._cores(w, now),
                sending=self._sending(w, now),
                retransmitting=(
                    None
                    if self.retransmitting is None or w.pid is None
                    else self.retransmitting(w.pid)
                ),
                vouched=self._vouched(w, now),
            )
            for lr, w, d in suspects
        ]
        if self._computing(out, now):
            return []
        out.sort(key=lambda h: (-h.silent_s, h.rank))
        return out

    def _computing(self, suspects: list[Hang], now: float) -> bool:
        """True (and every suspect's deadline moved on by one timeout) when they are slow, not
        hung (``slowness.slow_not_hung``)."""
        why, limit = slow_not_hung(suspects)
        if why is None:
            return False
        for h in suspects:
            w = self.workers[h.local_rank]
            w.extended_to = min(now + h.timeout_s, now - h.silent_s + limit * h.timeout_s)
            w.mark, w.sent_mark = self._mark(w, now), self._sent_mark(w, now)
        logger.info(
            "no heartbeat from rank(s) %s for %.2f s, but %s: slow, not hung; waiting up to "
            "%.2f s more",
            ", ".join(str(h.rank) for h in suspects),
            max(h.silent_s for h in suspects),
            why,
            min(h.timeout_s for h in suspects),
        )
        return True
