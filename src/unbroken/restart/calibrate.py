"""Calibrated hang timeouts: the soft and hard progress timeouts this job shows it needs.

The watchdog reports what it sees; ``Calibrator`` turns it into the timeouts in effect. It is
pure bookkeeping (durations are passed in), so tests drive it without a clock. Rules, for each
timeout the config leaves None (an explicit value always wins, unchanged):

- steady soft timeout: once ``timeout_warmup`` progress gaps have been seen (the time between
  two progress heartbeats of one iteration, after its first step, outside
  ``no_hang_protection`` regions), ``max(timeout_floor_s, timeout_factor x the largest of the
  last WINDOW gaps)``, at most the ceiling (60 s by default). Before that: the ceiling.
- initial soft timeout (an iteration's start to its first step: model build, restore, the
  first step): ``max(initial_timeout_floor_s, timeout_factor x the longest first step seen)``,
  at most its ceiling (600 s); the ceiling until one first step was seen.
- hard timeouts follow their soft one: ``max(HARD_RATIO x soft, soft + HARD_MARGIN_S)`` (10 s:
  an NCCL abort may take seconds), at most their ceiling.
- a phase's soft timeout (``RestartContext.phase``, while ``fn`` is inside it): the config's
  ``phase_timeouts_s[name]`` when given; else ``max(timeout_floor_s, timeout_factor x the
  longest time the phase took)``, at most the initial ceiling; the initial ceiling until the
  phase has ended once. Its hard timeout follows it like the others'.
- a value in effect moves only when the computed one differs from it by more than
  ``HYSTERESIS``; each move is a ledger ``tuned`` record (and the first calibrated value; a
  phase's names it in ``phase``).

Why these numbers (defaults 8 x, floor 1 s, warm-up 20 gaps): a 70 ms-step job's soft timeout
becomes the 1 s floor (a hang costs about a second, not a minute), which a 14x slowdown of its
steps does not reach; a slower job's timeout is 8 x its slowest recent gap, so a sudden 3-5x
slowdown (a busy 2-core machine at load 8) still leaves a margin of 1.6-2.7x.

The state persists in ``<run_dir>/calibration/rank<member>.json`` whenever a value moves or a
first step was timed, so a process the launcher restarts starts calibrated; an in-process
restart keeps the same object.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from pathlib import Path
from typing import Any

from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev
from unbroken.ledger.durable import write_atomic
from unbroken.restart.config import HARD_MARGIN_S, HARD_RATIO, RestartConfig

logger = logging.getLogger(__name__)

WINDOW = 1000
"""Recent progress gaps the steady timeout is sized on (a rarer slow event is forgotten)."""
HYSTERESIS = 1.1
"""A calibrated value moves only when the new one is this factor above or below it."""
STATE_DIR = "calibration"


def state_path(run_dir: Path, member: int) -> Path:
    """Where the calibration of launch rank ``member`` persists."""
    return run_dir / STATE_DIR / f"rank{member}.json"


class _WindowMax:
    """The maximum of the last ``size`` values, O(1) amortized per value."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.count = 0
        self._q: deque[tuple[int, float]] = deque()

    def add(self, value: float) -> None:
        while self._q and self._q[-1][1] <= value:
            self._q.pop()
        self._q.append((self.count, value))
        self.count += 1
        if self._q[0][0] <= self.count - 1 - self.size:
            self._q.popleft()

    @property
    def max(self) -> float:
        return self._q[0][1] if self._q else 0.0


def _derived_hard(soft: float, ceiling: float) -> float:
    return min(ceiling, max(HARD_RATIO * soft, soft + HARD_MARGIN_S))


def _moved(new: float, cur: float | None) -> bool:
    return cur is None or new > cur * HYSTERESIS or new < cur / HYSTERESIS


class Calibrator:
    """The timeouts in effect for one rank; ``gap`` and ``first_step`` feed it."""

    def __init__(
        self, config: RestartConfig, *, ledger: Recorder = NULL, path: Path | None = None
    ) -> None:
        self.config = config
        self._ceilings = config.ceilings()
        self.ledger = ledger
        self.path = path
        self.gaps = _WindowMax(WINDOW)
        self.samples = 0
        """Gaps seen in this job (persisted), the warm-up's count."""
        self.first_step_max_s = 0.0
        self.first_steps = 0
        self.soft_s: float | None = None
        """The calibrated steady soft timeout, None until warmed up."""
        self.initial_soft_s: float | None = None
        self.phase_max_s: dict[str, float] = {}
        """The longest time each phase took (persisted)."""
        self.phase_soft_s: dict[str, float] = {}
        """The calibrated soft timeout of each phase that ended at least once."""
        self._warned = False
        if path is not None:
            self._load(path)

    # --- what the watchdog asks ---------------------------------------------------------------
    def timeouts(self, *, initial: bool) -> tuple[float, float]:
        """(soft, hard) in effect before (initial) or after an iteration's first step."""
        c = self.config
        soft_c, hard_c, isoft_c, ihard_c = self._ceilings
        if initial:
            soft_x, hard_x, cal, s_ceil, h_ceil = (
                c.initial_soft_timeout_s,
                c.initial_hard_timeout_s,
                self.initial_soft_s,
                isoft_c,
                ihard_c,
            )
        else:
            soft_x, hard_x, cal, s_ceil, h_ceil = (
                c.soft_timeout_s,
                c.hard_timeout_s,
                self.soft_s,
                soft_c,
                hard_c,
            )
        soft = soft_x if soft_x is not None else min(s_ceil, cal if cal is not None else s_ceil)
        hard = hard_x if hard_x is not None else _derived_hard(soft, h_ceil)
        return soft, hard

    def phase_timeouts(self, name: str) -> tuple[float, float]:
        """(soft, hard) in effect while ``fn`` is inside phase ``name``."""
        _, _, isoft_c, ihard_c = self._ceilings
        given = self.config.phase_timeouts_s.get(name)
        if given is not None:
            soft = float(given)
            return soft, _derived_hard(soft, max(ihard_c, HARD_RATIO * soft))
        soft = min(isoft_c, self.phase_soft_s.get(name, isoft_c))
        return soft, _derived_hard(soft, ihard_c)

    # --- what the watchdog tells --------------------------------------------------------------
    def phase_ended(self, name: str, dur_s: float) -> None:
        """Phase ``name`` took ``dur_s`` (main thread; cheap unless a value moves)."""
        if name in self.config.phase_timeouts_s or dur_s <= self.phase_max_s.get(name, -1.0):
            return
        self.phase_max_s[name] = dur_s
        new = max(self.config.timeout_floor_s, self.config.timeout_factor * dur_s)
        previous = self.phase_soft_s.get(name)
        if _moved(new, previous):
            self.phase_soft_s[name] = new
            soft, hard = self.phase_timeouts(name)
            self.ledger.emit(
                ev.TUNED,
                name="phase_soft_timeout_s",
                phase=name,
                value=round(soft, 4),
                previous=None if previous is None else round(previous, 4),
                hard_s=round(hard, 4),
                layer="inprocess",
                phase_max_s=round(dur_s, 4),
            )
            self._save()

    def gap(self, gap_s: float) -> None:
        """A progress gap of the steady phase (main thread; cheap unless a value moves)."""
        if self.config.soft_timeout_s is not None:
            return
        self.gaps.add(gap_s)
        self.samples += 1
        if self.samples < self.config.timeout_warmup:
            return
        new = max(self.config.timeout_floor_s, self.config.timeout_factor * self.gaps.max)
        if _moved(new, self.soft_s):
            previous, self.soft_s = self.soft_s, new
            self._changed("soft_timeout_s", previous, initial=False)

    def first_step(self, dur_s: float) -> None:
        """An iteration's start to its first step took ``dur_s``."""
        if self.config.initial_soft_timeout_s is not None:
            return
        self.first_steps += 1
        self.first_step_max_s = max(self.first_step_max_s, dur_s)
        new = max(
            self.config.initial_timeout_floor_s, self.config.timeout_factor * self.first_step_max_s
        )
        if _moved(new, self.initial_soft_s):
            previous, self.initial_soft_s = self.initial_soft_s, new
            self._changed("initial_soft_timeout_s", previous, initial=True)
        else:
            self._save()

    # --- records and persistence --------------------------------------------------------------
    def _changed(self, name: str, previous: float | None, *, initial: bool) -> None:
        soft, hard = self.timeouts(initial=initial)
        self.ledger.emit(
            ev.TUNED,
            name=name,
            value=round(soft, 4),
            previous=None if previous is None else round(previous, 4),
            hard_s=round(hard, 4),
            layer="inprocess",
            gap_max_s=round(self.gaps.max, 4),
            samples=self.samples,
            first_step_max_s=round(self.first_step_max_s, 4),
        )
        self._save()

    def state(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "gap_max_s": self.gaps.max,
            "soft_s": self.soft_s,
            "first_steps": self.first_steps,
            "first_step_max_s": self.first_step_max_s,
            "initial_soft_s": self.initial_soft_s,
            "phase_max_s": self.phase_max_s,
            "phase_soft_s": self.phase_soft_s,
        }

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # atomic, not fsynced: it is written at every change; a lost update recalibrates
            write_atomic(self.path, json.dumps(self.state()), durable=False)
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "could not persist the hang-timeout calibration to %s: %s", self.path, e
                )

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            samples, gap_max = int(raw["samples"]), float(raw["gap_max_s"])
            soft = None if raw["soft_s"] is None else float(raw["soft_s"])
            first_steps, first_max = int(raw["first_steps"]), float(raw["first_step_max_s"])
            isoft = None if raw["initial_soft_s"] is None else float(raw["initial_soft_s"])
            phase_max = {str(k): float(v) for k, v in dict(raw.get("phase_max_s") or {}).items()}
            phase_soft = {str(k): float(v) for k, v in dict(raw.get("phase_soft_s") or {}).items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable hang-timeout calibration %s: %s", path, e)
            return
        # The largest gap seen stands for the window until WINDOW new gaps replace it.
        self.samples, self.soft_s = samples, soft
        if samples > 0:
            self.gaps.add(gap_max)
        self.first_steps, self.first_step_max_s, self.initial_soft_s = first_steps, first_max, isoft
        self.phase_max_s, self.phase_soft_s = phase_max, phase_soft
        for name, value, initial in (
            ("soft_timeout_s", soft, False),
            ("initial_soft_timeout_s", isoft, True),
        ):
            if value is not None and getattr(self.config, name) is None:
                in_effect, hard = self.timeouts(initial=initial)
                self.ledger.emit(
                    ev.TUNED,
                    name=name,
                    value=round(in_effect, 4),
                    previous=None,
                    hard_s=round(hard, 4),
                    layer="inprocess",
                    restored=True,
                    samples=samples,
                )
