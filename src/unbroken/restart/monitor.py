"""The monitor: the threads that watch one rank while ``fn`` runs, and interrupt it.

- ``unbroken-restart-watchdog`` wakes every ``monitor_interval_s`` on a fixed schedule and
  does no blocking I/O: it probes the main thread, evaluates the watchdog, re-arms the GIL-free
  backstop, and delivers interrupts while a restart is pending.
- ``unbroken-restart-peers`` blocks on this rank's wake key of the iteration in the
  coordination store (no polling): a peer that detects a fault writes its report into every
  other rank's wake key; ``fn_exited`` writes "stop" into our own.
- ``unbroken-restart-report`` (one per detection) publishes a watchdog detection to the store,
  then closes the process group's connections, so a victim's collective error is always
  published after the report that caused it.

A restart request (from any of them, or from the main thread when ``fn`` raised) does, once
per iteration: record the detection (ledger ``fault_detected``), publish it if it is ours,
close the process group's connections (which frees every collective on them, ours and the
peers'), and interrupt ``fn`` until it returns.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from unbroken.errors import Preempted, stop_job_of
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev
from unbroken.ledger.busy import proc_sent_bytes
from unbroken.mask import masked
from unbroken.restart import assign
from unbroken.restart.calibrate import Calibrator
from unbroken.restart.config import RestartConfig
from unbroken.restart.interrupt import Interrupter, python_probe
from unbroken.restart.lossy import OwnConnections
from unbroken.restart.pg import Transport
from unbroken.restart.store import Keys, StoreHost
from unbroken.restart.watchdog import KILL, NONE, RESTART, Backstop, Verdict, Watchdog

logger = logging.getLogger(__name__)

_STOP = "stop"
_WAIT_FOREVER = timedelta(days=7)


@dataclass(frozen=True)
class Armed:
    """The iteration the monitor watches."""

    iteration: int
    keys: Keys
    member: int
    rank: int
    members: tuple[int, ...]
    transport: Transport


@dataclass(frozen=True)
class Detection:
    """A fault as this rank learned of it."""

    kind: str
    """assign.EXCEPTION, HANG, STUCK or PEER."""
    detector: str
    """"exception", "watchdog" or "peer"."""
    message: str
    fault_rank: int
    """Rank (in the iteration) that faulted, as far as this rank knows."""
    origin: bool
    """Detected here (True) or reported by a peer."""


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _own_sent_bytes() -> int | None:
    return proc_sent_bytes(os.getpid())


class Monitor:
    """Watches the main thread and the peers of one rank across iterations."""

    def __init__(
        self,
        *,
        config: RestartConfig,
        ledger: Recorder,
        interrupter: Interrupter,
        store: StoreHost,
        kill: Callable[[], None] = _sigkill_self,
        calibrator: Calibrator | None = None,
        on_waiting: Callable[[str], None] | None = None,
    ) -> None:
        """``on_waiting(why)`` is called on every check while the watchdog waits for this
        rank because its network is slow (not hung): ``unbroken.job`` passes the launcher's
        ``client.waiting``, so that the node agent waits too."""
        self.config = config
        self._on_waiting = on_waiting
        self.ledger = ledger
        self.interrupter = interrupter
        self.watchdog = Watchdog(
            config, calibrator, sent_bytes=_own_sent_bytes, link_loss=OwnConnections().loss
        )
        self._told_sending = False
        self._kill_fn = kill
        self._probe = python_probe()
        self._backstop = Backstop(config.backstop_margin_s)
        self._lock = threading.Condition()
        self._publish_lock = threading.Lock()
        self._armed: Armed | None = None
        self._gen = 0
        self._watched_gen = 0
        self._detection: Detection | None = None
        self._requested_at = 0.0
        self._last_interrupt = 0.0
        self._seq: int | None = None
        self._killed = False
        self._closing = False
        self._reporter: threading.Thread | None = None
        self._watch_client: Any = store.client(timeout_s=config.store_timeout_s)
        self._report_client: Any = store.client(timeout_s=config.store_timeout_s)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watchdog_loop, name="unbroken-restart-watchdog"),
            threading.Thread(target=self._peers_loop, name="unbroken-restart-peers"),
        ]
        for t in self._threads:
            t.daemon = True
            t.start()

    # --- main thread -------------------------------------------------------------------------
    def arm(self, armed: Armed) -> None:
        """fn is about to run in ``armed.iteration``."""
        now = time.monotonic()
        with self._lock:
            self._armed = armed
            self._detection = None
            self._seq = None
            self._reporter = None
            self._probe.reset(now)
            self.watchdog.arm(now)
            self._backstop.update(self.watchdog.deadline(), now)
            self._gen += 1
            self._lock.notify_all()

    def progress(self, *, step: bool = True) -> None:
        """A heartbeat from the main thread (lock-free: two attribute writes)."""
        self.watchdog.progress(time.monotonic(), step=step)

    @masked  # called from fn: the phase stack is changed whole or not at all
    def enter_phase(self, name: str) -> None:
        """fn entered named phase ``name`` (lock-free: the watchdog reads a replaced tuple)."""
        self.watchdog.enter_phase(name, time.monotonic())

    @masked
    def exit_phase(self, name: str) -> None:
        """fn left phase ``name``."""
        self.watchdog.exit_phase(name, time.monotonic())

    @masked  # called from fn: an interrupt must not leave the monitor's lock held
    def protect(self, *, enter: bool) -> None:
        with self._lock:
            self.watchdog.protect(time.monotonic(), enter=enter)

    def fn_exited(self, error: BaseException | None) -> tuple[Detection | None, int | None]:
        """fn returned or raised: stop watching; on a new fault publish it and abort the
        group. Returns the iteration's detection (None: clean) and our report's sequence."""
        with self._lock:
            armed = self._armed
            self.watchdog.disarm()
            mine = self._detection is None and error is not None
            if mine:
                assert armed is not None
                stopped = isinstance(stop_job_of(error), Preempted)
                self._detection = Detection(
                    kind=assign.STOP if stopped else assign.EXCEPTION,
                    detector="preempted" if stopped else "exception",
                    message=f"{type(error).__name__}: {error}"[:500],
                    fault_rank=armed.rank,
                    origin=True,
                )
            detection = self._detection
        self._backstop.cancel()
        assert armed is not None
        if mine and detection is not None:
            if detection.kind != assign.STOP:  # a graceful stop is no fault
                self._emit_detected(detection)
            self._publish(armed, detection)
            armed.transport.close()
        if self._reporter is not None:
            self._reporter.join()
        self._release_watcher(armed)
        with self._lock:
            self._armed = None
        return detection, self._seq

    def close(self) -> None:
        """Stop every thread; idempotent."""
        armed = self._armed
        if armed is not None:  # run is unwinding from inside an iteration
            self._release_watcher(armed)
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._stop.set()
        self._backstop.cancel()
        for t in self._threads:
            t.join(self.config.store_timeout_s)
        self._watch_client = None
        self._report_client = None

    # --- any thread --------------------------------------------------------------------------
    def request_restart(self, detection: Detection, armed: Armed) -> None:
        """Begin a restart of ``armed``'s iteration (ignored if stale or already begun)."""
        with self._lock:
            if self._armed is not armed or self._detection is not None:
                return
            self._detection = detection
            self._requested_at = time.monotonic()
            self.watchdog.requested(self._requested_at)
            self._emit_detected(detection)
            if detection.origin:  # started under the lock: fn_exited may join it at once
                self._reporter = threading.Thread(
                    target=self._report,
                    args=(armed, detection),
                    name="unbroken-restart-report",
                    daemon=True,
                )
                self._reporter.start()
        if not detection.origin:
            armed.transport.close()
        if self.interrupter.interrupt():
            self._last_interrupt = time.monotonic()

    def hand_over(self, why: str) -> None:
        """The node agent hands this worker to the next round (``restart.handover``): ``fn`` is
        interrupted as for a peer's fault; no fault is recorded here (the agent records the
        lost node). Any thread; nothing happens between iterations (the barrier asks)."""
        with self._lock:
            armed = self._armed
        if armed is not None:
            detection = Detection(
                kind=assign.HANDOVER,
                detector="launcher",
                message=f"handed over to the next round: {why}",
                fault_rank=-1,
                origin=False,
            )
            self.request_restart(detection, armed)

    def _emit_detected(self, d: Detection) -> None:
        if d.kind == assign.HANDOVER:
            return
        self.ledger.emit(
            ev.FAULT_DETECTED,
            cause=d.kind,
            detector=d.detector,
            layer="inprocess",
            fault_rank=d.fault_rank,
            message=d.message,
        )

    def _report(self, armed: Armed, detection: Detection) -> None:
        self._publish(armed, detection)
        armed.transport.close()

    def _publish(self, armed: Armed, detection: Detection) -> None:
        """Wake every other rank with our report; records our sequence number. Once."""
        with self._publish_lock:
            if self._seq is not None or self._report_client is None:
                return
            keys, it = armed.keys, armed.iteration
            try:
                seq = int(self._report_client.add(keys.reports(it), 1))
                payload = json.dumps(
                    {
                        "member": armed.member,
                        "rank": armed.rank,
                        "kind": detection.kind,
                        "seq": seq,
                        "message": detection.message,
                    }
                )
                others = [keys.wake(it, m) for m in armed.members if m != armed.member]
                if others:
                    self._report_client.multi_set(others, [payload] * len(others))
                self._seq = seq
            except Exception as e:  # noqa: BLE001 - peers still learn from the closed group
                logger.warning("could not publish the fault to the coordination store: %s", e)

    def _release_watcher(self, armed: Armed) -> None:
        with self._lock:
            if self._watched_gen >= self._gen:
                return
        try:
            assert self._report_client is not None
            self._report_client.set(armed.keys.wake(armed.iteration, armed.member), _STOP)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not release the peer watcher: %s", e)
            return
        with self._lock:
            self._lock.wait_for(
                lambda: self._watched_gen >= self._gen, timeout=self.config.store_timeout_s
            )

    # --- threads -----------------------------------------------------------------------------
    def _watchdog_loop(self) -> None:
        interval = self.config.monitor_interval_s
        redeliver_s = max(0.1, 4 * interval)
        next_t = time.monotonic()
        while True:
            next_t += interval
            now = time.monotonic()
            if next_t < now:  # fell behind (starved): do not burst, keep the period
                next_t = now
            if self._stop.wait(next_t - now):
                return
            now = time.monotonic()
            silent_s = self._probe.poll(now)
            with self._lock:
                armed = self._armed
                verdict = self.watchdog.evaluate(now, silent_s=silent_s)
                deadline = self.watchdog.deadline()
                pending = self._detection is not None
            self._backstop.update(deadline, now)
            if armed is None:
                continue
            self._tell_sending(verdict)
            if verdict.action == RESTART:
                self.request_restart(
                    Detection(
                        kind=verdict.kind,
                        detector="watchdog",
                        message=verdict.describe(),
                        fault_rank=armed.rank,
                        origin=True,
                    ),
                    armed,
                )
            elif verdict.action == KILL:
                self._kill(verdict, armed)
            elif (
                pending
                and now - self._last_interrupt >= redeliver_s
                and self.interrupter.interrupt()
            ):
                self._last_interrupt = now

    def _tell_sending(self, verdict: Verdict) -> None:
        """Log once per silence that the rank is waited for because the network is slow, and
        tell ``on_waiting`` on every check meanwhile."""
        why = self.watchdog.waiting_why()
        if why is None or verdict.action != NONE:
            self._told_sending = False
            return
        if self._on_waiting is not None:
            self._on_waiting(f"slow network, not hung: {why}")
        if not self._told_sending:
            self._told_sending = True
            logger.warning(
                "no progress past the soft timeout, but %s (a collective over a slow "
                "network): slow, not hung; waiting",
                why,
            )

    def _kill(self, verdict: Verdict, armed: Armed) -> None:
        if self._killed:
            return
        self._killed = True
        logger.error("rank %d: hard timeout (%s); killing the process", armed.rank, verdict)
        self.ledger.emit(
            ev.FAULT_DETECTED,
            cause=verdict.kind,
            detector="watchdog-hard",
            layer="launcher",
            fault_rank=armed.rank,
            message=verdict.describe(),
        )
        self.ledger.emit(ev.ESCALATE, reason=f"hard timeout: {verdict.describe()}")
        self.ledger.flush(1.0)
        self._kill_fn()

    def _peers_loop(self) -> None:
        seen = 0
        while True:
            with self._lock:
                while not self._closing and self._gen == seen:
                    self._lock.wait()
                if self._closing:
                    return
                seen = self._gen
                armed = self._armed
            if armed is not None:
                self._watch(armed)
            with self._lock:
                self._watched_gen = seen
                self._lock.notify_all()

    def _watch(self, armed: Armed) -> None:
        key = armed.keys.wake(armed.iteration, armed.member)
        client = self._watch_client
        assert client is not None
        try:
            client.wait([key], _WAIT_FOREVER)
            raw = client.get(key)
        except Exception as e:  # noqa: BLE001 - the next barrier reports the store's loss
            if not self._closing:
                logger.warning("peer watcher lost the coordination store: %s", e)
            return
        if raw == _STOP.encode():
            return
        try:
            report = json.loads(raw)
            told = f"rank {int(report['rank'])} reported {report['kind']}: {report['message']}"
        except (ValueError, KeyError, TypeError, RecursionError):  # not written by a peer of ours
            logger.warning("ignored a malformed wake-up in the coordination store: %.80r", raw)
            return
        if report["kind"] == assign.STOP:  # we are on our way to the same stop: no restart
            logger.info("%s", told)
            return
        now = time.monotonic()
        with self._lock:
            suspect = self.watchdog.suspect(now, silent_s=now - self._probe.last_python)
            idle = now - self.watchdog.last_progress
        if suspect == assign.HANG:  # we hang ourselves: the peer is stuck waiting for us
            detection = Detection(
                kind=assign.HANG,
                detector="watchdog",
                message=f"hang: no progress for {idle:.3f}s ({told})",
                fault_rank=armed.rank,
                origin=True,
            )
        else:
            detection = Detection(
                kind=assign.PEER,
                detector="peer",
                message=told,
                fault_rank=int(report["rank"]),
                origin=False,
            )
        self.request_restart(detection, armed)
