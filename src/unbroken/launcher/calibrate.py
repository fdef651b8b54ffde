"""The agent's automatic heartbeat timeouts (on by default): sized on what the job has shown.

Pure functions of ``monitor.Observed`` (what the agent saw of this job's heartbeats, persisted
in ``<run_dir>/launcher/heartbeats.json`` so a restarted agent starts calibrated):

- steady (between two heartbeats): once ``WARMUP`` steady gaps were seen,
  ``max(STEADY_FLOOR_S, 4 x heartbeat interval, factor x the largest gap seen)``;
- initial (a worker's start to its first heartbeat: imports, rendezvous, model build, restore,
  first step): once one was seen, ``max(INITIAL_FLOOR_S, 4 x heartbeat interval, factor x the
  longest seen)``;
- never above the configured timeout, which is also the value until calibrated; an explicit
  ``--ft-steady-timeout-s`` / ``--ft-initial-timeout-s`` turns the automatic timeouts off
  (``config.build``) unless ``--ft-auto-timeouts`` is given too.

A worker "finishing" (past its last step, or restarting in-process: its training function
ended) keeps the configured initial timeout: a final save or a restart is no step.

Why these numbers (factor 16, floor 3 s): the in-process watchdog's calibrated soft timeout is
max(1 s, 8 x the largest gap); the agent's is at least twice that and 2 s longer, so in a job
with in-process restart the watchdog acts first and its rank has said "finishing" before the
agent's steady timeout runs out. A job with 70 ms steps without in-process restart has its hang
caught by the agent in 3 s.
"""

from __future__ import annotations

from collections.abc import Callable

STEADY_FLOOR_S = 3.0
INITIAL_FLOOR_S = 60.0
WARMUP = 20
"""Steady gaps seen before the steady timeout is calibrated."""
HYSTERESIS = 1.1
"""A value in effect moves only when the computed one is this factor above or below it."""

OnChange = Callable[[str, float, "float | None"], object]
"""``(name, value, previous)``: a timeout in effect moved (previous None: first value)."""


def steady_s(
    gap_max_s: float, samples: int, *, configured: float, factor: float, interval_s: float
) -> float | None:
    """The calibrated steady timeout, or None while there are fewer than WARMUP gaps."""
    if samples < WARMUP:
        return None
    return min(configured, max(STEADY_FLOOR_S, 4 * interval_s, factor * gap_max_s))


def initial_s(
    initial_max_s: float, samples: int, *, configured: float, factor: float, interval_s: float
) -> float | None:
    """The calibrated initial timeout, or None before a first heartbeat was timed."""
    if samples < 1:
        return None
    return min(configured, max(INITIAL_FLOOR_S, 4 * interval_s, factor * initial_max_s))


class InEffect:
    """One timeout in effect: the configured value until calibrated, then the calibrated one,
    moving only past the hysteresis; each move is reported."""

    def __init__(self, name: str, configured: float, on_change: OnChange | None) -> None:
        self.name = name
        self.configured = configured
        self.calibrated: float | None = None
        self.on_change = on_change

    @property
    def value(self) -> float:
        return self.configured if self.calibrated is None else self.calibrated

    def offer(self, new: float | None) -> None:
        cur = self.calibrated
        if new is None or (cur is not None and cur / HYSTERESIS <= new <= cur * HYSTERESIS):
            return
        self.calibrated = new
        if self.on_change is not None:
            self.on_change(self.name, new, cur)
