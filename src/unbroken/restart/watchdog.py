"""The progress watchdog: on a fixed schedule, decide whether the main thread is hung.

Two questions, two signals:
- progress: the time since the last step heartbeat (``RestartContext.step_done``); past the
  soft timeout the rank is hung (-> in-process restart), past the hard timeout it is killed;
- is it executing Python at all: the time since the main thread last ran bytecode
  (``interrupt.PythonProbe``). A rank without progress that still runs Python is *hung* (a
  loop, a swallowed error); one that runs no Python is *stuck* in native code (a collective
  whose peer never comes, a deadlock). The kind names the cause; the action is the same.

The timeouts come from ``calibrate.Calibrator``: the watchdog hands it every progress gap of
the steady phase (outside ``no_hang_protection`` regions, named phases and pending restarts),
every iteration's time to its first step and every named phase's duration, and asks it for the
timeouts in effect: inside a named phase (``RestartContext.phase``) the innermost phase's,
counted from its entry or the last heartbeat in it.

Slow, not hung: a rank whose collective crawls over a degraded network (delay, loss) makes no
progress and runs no Python, like a stuck one, but its data trickles out. When the soft (or
hard) timeout passes, the watchdog asks how many bytes the process passed to write calls since
it became a suspect (half a timeout without progress; ``sent_bytes``, /proc's ``wchar``,
sockets included): at ``SENDING_BYTES_S`` a second or more, it is communicating, and the
verdict waits, for at most ``SENDING_LIMIT`` timeouts of silence. A hung collective sends
nothing (its peer never takes the data), nor does a Python loop. A lossy link can stall a
collective without a byte written while TCP waits out its retransmission timeout; then the
process's TCP connections show segments lost since the progress clock last moved
(``link_loss``, ``lossy``), which excuses the silence just the same, unless a peer has stopped
acknowledging altogether (unreachable: its node is gone).

This module only decides; it owns no thread and does no I/O of its own (the calibrator writes a
small file when a calibrated value moves), so tests drive it with a fake clock. ``monitor.Monitor`` calls ``evaluate`` every ``monitor_interval_s`` from its own
thread, never from one that waits on the store, so checks fire on time whatever the message
traffic. A main thread that holds the GIL in native code starves every Python thread; the
``Backstop`` (faulthandler's C timer) ends the process then.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.restart.calibrate import Calibrator
from unbroken.restart.config import RestartConfig
from unbroken.restart.lossy import Loss

logger = logging.getLogger(__name__)

NONE = "none"
RESTART = "restart"
KILL = "kill"

SENDING_BYTES_S = 4096.0
"""Bytes a second a rank without progress must write to be communicating, not hung (what the
launcher's rule uses too: ``launcher.slowness``)."""
SENDING_LIMIT = 30.0
"""Timeouts of silence a communicating rank is given at most."""
LOSS_SAMPLE_S = 0.25
"""The connections' loss is read at most this often: when the progress clock has moved since
the last reading (a few microseconds a socket, off the training thread)."""

SentBytes = Callable[[], "int | None"]
"""Bytes this process has passed to write calls so far (None: unknown)."""
LinkLoss = Callable[[], "Loss | None"]
"""Loss on this process's TCP connections so far (``lossy.OwnConnections.loss``)."""

HANG = "hang"
"""No progress, main thread executing Python."""
STUCK = "stuck"
"""No progress, main thread not executing Python (native code)."""
EXIT_TIMEOUT = "exit_timeout"
"""A restart was requested, but fn did not return in time."""


@dataclass(frozen=True)
class Verdict:
    """What the watchdog wants done now."""

    action: str
    """NONE, RESTART or KILL."""
    kind: str = ""
    """HANG, STUCK or EXIT_TIMEOUT."""
    idle_s: float = 0.0
    """Seconds since the last progress heartbeat."""
    silent_s: float = 0.0
    """Seconds since the main thread last executed Python."""
    phase: str = ""
    """The named phase the rank was in ("": none)."""

    @property
    def main_state(self) -> str:
        return "native" if self.kind == STUCK else "python"

    def describe(self) -> str:
        where = f" in phase {self.phase}" if self.phase else ""
        return (
            f"{self.kind}{where}: no progress for {self.idle_s:.3f}s, "
            f"no Python executed for {self.silent_s:.3f}s"
        )


_QUIET = Verdict(NONE)


class Watchdog:
    """Progress deadlines of one rank; every method takes ``now`` (monotonic seconds)."""

    def __init__(
        self,
        config: RestartConfig,
        calibrator: Calibrator | None = None,
        *,
        sent_bytes: SentBytes | None = None,
        link_loss: LinkLoss | None = None,
    ) -> None:
        self.config = config
        self.calibrator = calibrator or Calibrator(config)
        self.sent_bytes = sent_bytes
        """This process's bytes written so far (None: the rule is off)."""
        self.link_loss = link_loss
        """Loss on this process's connections so far (None: the rule is off)."""
        self._loss_base: tuple[float, float, Loss] | None = None
        """(progress clock start, when, the reading then): the newest reading, taken before
        the progress clock's last move, or after it."""
        self.lost_segments: int | None = None
        """Segments lost since the progress clock moved, when the last verdict that waited
        waited for them (for the log)."""
        self._suspect: tuple[float, int] | None = None
        """(when, bytes written then) since the progress clock last moved, past half a soft
        timeout; None before."""
        self.sending_bps: float | None = None
        """The rate the last verdict that waited saw (for the log)."""
        self.armed = False
        self.armed_at = 0.0
        self.first_step_seen = False
        self.last_progress = 0.0
        self.protect_depth = 0
        self.phases: tuple[tuple[str, float], ...] = ()
        """The named phases fn is in, (name, entered at), innermost last; replaced, never
        mutated, so the watchdog thread reads a consistent value without the lock."""
        self.requested_at: float | None = None
        # The calibration's gap runs from one progress to the next, less protected regions
        # inside it (a per-step snapshot or save just before ``step_done`` must not hide the
        # step's own time from the calibration).
        self.gap_start = 0.0
        self.protected_s = 0.0
        self.protect_since = 0.0

    def arm(self, now: float) -> None:
        """fn is about to be called: initial timeouts run from now."""
        self.armed = True
        self.armed_at = now
        self.first_step_seen = False
        self.last_progress = now
        self.protect_depth = 0
        self.phases = ()
        self.requested_at = None
        self.gap_start = now
        self.protected_s = 0.0

    def disarm(self) -> None:
        self.armed = False

    def progress(self, now: float, *, step: bool) -> None:
        """A heartbeat; ``step`` ends the initial phase. Feeds the calibration."""
        if not self._excluding() and self.requested_at is None:
            if self.first_step_seen:
                self.calibrator.gap(max(0.0, now - self.gap_start - self.protected_s))
            elif step:
                self.calibrator.first_step(now - self.armed_at - self.protected_s)
        self.last_progress = now
        self.gap_start = now
        self.protected_s = 0.0
        self.sending_bps = None
        self.lost_segments = None
        if step:
            self.first_step_seen = True

    def _excluding(self) -> bool:
        """In a region the step gaps leave out (unprotected or a named phase)."""
        return self.protect_depth > 0 or bool(self.phases)

    def protect(self, now: float, *, enter: bool) -> None:
        """Enter or leave a region without hang protection; leaving restarts the clock."""
        was = self._excluding()
        self.protect_depth += 1 if enter else -1
        assert self.protect_depth >= 0, "unbalanced no_hang_protection"
        if enter and not was:
            self.protect_since = now
        if not enter and self.protect_depth == 0:
            self.last_progress = now
            if not self._excluding():
                self.protected_s += now - self.protect_since

    def enter_phase(self, name: str, now: float) -> None:
        """fn entered named phase ``name``: its timeouts apply until it leaves."""
        if not self._excluding():
            self.protect_since = now
        self.phases = (*self.phases, (name, now))

    def exit_phase(self, name: str, now: float) -> None:
        """fn left phase ``name`` (the innermost): its duration feeds the calibration, and
        the progress clock restarts."""
        if not self.phases or self.phases[-1][0] != name:
            return  # its entry was cut short (an interrupt): nothing to leave
        since = self.phases[-1][1]
        self.phases = self.phases[:-1]
        if self.requested_at is None:
            self.calibrator.phase_ended(name, now - since)
        self.last_progress = now
        if not self._excluding():
            self.protected_s += now - self.protect_since

    def _limits(self) -> tuple[float, float, float, str]:
        """(soft, hard, progress clock start, phase name) in effect now."""
        phases = self.phases
        if phases:
            name, since = phases[-1]
            soft, hard = self.calibrator.phase_timeouts(name)
            return soft, hard, max(self.last_progress, since), name
        soft, hard = self.calibrator.timeouts(initial=not self.first_step_seen)
        return soft, hard, self.last_progress, ""

    def requested(self, now: float) -> None:
        """A restart was requested (by us or a peer): fn now has exit_timeout_s to return."""
        if self.requested_at is None:
            self.requested_at = now

    def evaluate(self, now: float, *, silent_s: float) -> Verdict:
        if not self.armed:
            return _QUIET
        soft, hard, since, phase = self._limits()
        idle = now - since
        protected = self.protect_depth > 0
        if self.requested_at is not None:
            if now - self.requested_at > self.config.exit_timeout_s:
                return Verdict(KILL, EXIT_TIMEOUT, idle, silent_s, phase)
            if not protected and idle > hard:
                return Verdict(KILL, self._kind(silent_s, soft), idle, silent_s, phase)
            return _QUIET
        if protected:
            return _QUIET
        self._read_loss(now, since)
        if idle > soft and (self._sending(now, since, soft) or self._lossy(now, since, soft)):
            return _QUIET
        if idle > hard:
            return Verdict(KILL, self._kind(silent_s, soft), idle, silent_s, phase)
        if idle > soft:
            return Verdict(RESTART, self._kind(silent_s, soft), idle, silent_s, phase)
        if idle >= 0.5 * soft:
            self._mark_suspect(now, since)
        return _QUIET

    def _mark_suspect(self, now: float, since: float) -> None:
        if self.sent_bytes is None or (self._suspect is not None and self._suspect[0] >= since):
            return
        sent = self.sent_bytes()
        self._suspect = None if sent is None else (now, sent)

    def _sending(self, now: float, since: float, soft: float) -> bool:
        """Slow, not hung: sent (acknowledged) ``SENDING_BYTES_S`` a second since it became a
        suspect, and silent for fewer than ``SENDING_LIMIT`` timeouts (see the module docstring)."""
        suspect = self._suspect
        if self.sent_bytes is None or suspect is None or suspect[0] < since:
            return False
        if now - since > SENDING_LIMIT * soft or now <= suspect[0]:
            return False
        sent = self.sent_bytes()
        if sent is None:
            return False
        rate = (sent - suspect[1]) / (now - suspect[0])
        if rate < SENDING_BYTES_S:
            return False
        self.sending_bps = rate
        return True

    def _read_loss(self, now: float, since: float) -> None:
        base = self._loss_base
        if self.link_loss is None or (
            base is not None and (base[0] == since or now - base[1] < LOSS_SAMPLE_S)
        ):
            return
        reading = self.link_loss()
        self._loss_base = None if reading is None else (since, now, reading)

    def _lossy(self, now: float, since: float, soft: float) -> bool:
        """Slow, not hung: segments lost on this process's connections since the progress
        clock moved (or up to ``LOSS_SAMPLE_S`` before), no peer unreachable, silent for fewer
        than ``SENDING_LIMIT`` timeouts."""
        base = self._loss_base
        if self.link_loss is None or base is None:
            return False
        if now - since > SENDING_LIMIT * soft:
            return False
        loss = self.link_loss()
        if loss is None or loss.unreachable:
            return False
        lost = loss.since(base[2])
        if not lost:
            return False
        self.lost_segments = lost
        return True

    def waiting_why(self) -> str | None:
        """What the last verdict waited for on a slow network (sending, or segments lost), in
        words; None when it did not."""
        if self.sending_bps is not None:
            return f"this rank is sending {self.sending_bps / 1000:.0f} kB/s"
        if self.lost_segments is not None:
            return f"its connections lost {self.lost_segments} segment(s) meanwhile"
        return None

    def suspect(self, now: float, *, silent_s: float) -> str | None:
        """HANG or STUCK when the rank has been without progress for half its soft timeout
        (not yet a verdict). Used when a peer's report arrives: a rank that is itself hanging
        in Python must own up to it rather than pass for the peer's victim."""
        if not self.armed or self.protect_depth > 0 or self.requested_at is not None:
            return None
        soft, _, since, _ = self._limits()
        if now - since < 0.5 * soft:
            return None
        return self._kind(silent_s, soft)

    @staticmethod
    def _kind(silent_s: float, soft: float) -> str:
        # Stuck when the main thread ran no Python for most of the soft timeout.
        return STUCK if silent_s >= 0.5 * soft else HANG

    def deadline(self) -> float | None:
        """Monotonic time at which ``evaluate`` will say KILL, or None (not armed/protected)."""
        if not self.armed:
            return None
        soft, hard, since, _ = self._limits()
        limits = []
        if self.protect_depth == 0:
            suspect = self._suspect
            waiting = (
                self.sending_bps is not None and suspect is not None and suspect[0] >= since
            ) or self.lost_segments is not None  # set by _lossy since the clock last moved
            limits.append(since + (SENDING_LIMIT * soft + hard if waiting else hard))
        if self.requested_at is not None:
            limits.append(self.requested_at + self.config.exit_timeout_s)
        return min(limits) if limits else None


class Backstop:
    """A GIL-free kill timer: faulthandler's C thread exits the process (code 1, tracebacks on
    stderr) ``margin_s`` after a watchdog deadline that the watchdog thread failed to act on.

    Re-armed only when the deadline moves earlier or later by more than ``slack_s``, so a
    training loop's heartbeats do not restart the C thread every step. Armed by the main thread
    when fn starts (a main thread that takes the GIL at once never lets the watchdog thread
    run), then kept up to date by the watchdog thread: it fires only when that thread was
    starved past a deadline it knew, by ``margin_s - slack_s`` at least.
    """

    def __init__(self, margin_s: float | None) -> None:
        self.margin_s = margin_s
        self.slack_s = 0.0 if margin_s is None else min(1.0, margin_s / 2)
        self._target: float | None = None
        self._lock = threading.Lock()

    def update(self, deadline: float | None, now: float) -> None:
        """Arm for ``deadline`` (monotonic; None: cancel). Any thread."""
        if self.margin_s is None:
            return
        if deadline is None:
            self.cancel()
            return
        target = deadline + self.margin_s
        with self._lock:
            if self._target is not None and self._target <= target <= self._target + self.slack_s:
                return
            try:
                faulthandler.dump_traceback_later(
                    max(target - now, 0.001), exit=True, file=sys.stderr
                )
            except (ValueError, RuntimeError, OSError) as e:  # no usable stderr
                logger.warning("watchdog backstop unavailable: %s", e)
                self.margin_s = None
                return
            self._target = target

    def cancel(self) -> None:
        with self._lock:
            if self._target is not None:
                faulthandler.cancel_dump_traceback_later()
                self._target = None
