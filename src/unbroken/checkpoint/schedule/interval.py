"""The adaptive durable-checkpoint interval: Young/Daly from what the job measures.

The first-order optimum of the time between checkpoints is ``sqrt(2 x C x MTBF)`` (Young 1974;
Daly 2006), with ``C`` what one checkpoint costs the training and ``MTBF`` the mean time between
failures. Here:

- ``C`` = the trainer's blocking time of a save (staging, waiting) + the time persisting took
  from training (the steps that ran while the writer persisted, less the same steps at the
  speed of steps without a save in flight);
- ``MTBF`` = (training time so far + ``mtbf_prior_s``) / (failures so far + 1): the prior rules
  until the job has seen failures, then the observed rate takes over;
- the interval is at least the persist time (an async save due while the previous one persists
  would be skipped), converted to steps with the mean step time, and bounded by
  ``[min_steps, max_steps]``.

Every rank must save at the same steps, so the interval is only ever changed at a save, from
figures all ranks agree on (``agree``: one small max-reduction per save, through a function the
caller passes in, e.g. a gloo all-reduce). Saving at other steps never changes the training
state: a restore still loads the newest committed step, and the run stays bit-exact.

Pure: no torch, no clock; ``train.py`` feeds it. The failure count and training time persist in
``<ckpt_dir>/interval.json`` (rank 0 writes it at each save), so a relaunched job keeps its rate.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev
from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)

STATE_FILE = "interval.json"
_EMA = 0.2  # weight of the newest sample in the running means


@dataclass(frozen=True, kw_only=True)
class IntervalConfig:
    """Bounds and prior of the adaptive interval."""

    initial_steps: int
    """The interval until the first save has been measured."""
    min_steps: int = 1
    """Never save more often than every this many steps."""
    max_steps: int = 1000
    """Never save less often than every this many steps."""
    mtbf_prior_s: float = 3600.0
    """The mean time between failures assumed before any was seen (weight: this much time)."""

    def __post_init__(self) -> None:
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}")
        if self.max_steps < self.min_steps:
            raise ValueError(
                f"max_steps ({self.max_steps}) must be >= min_steps ({self.min_steps})"
            )
        if not self.min_steps <= self.initial_steps <= self.max_steps:
            raise ValueError(
                f"initial_steps ({self.initial_steps}) must lie in [min_steps, max_steps] = "
                f"[{self.min_steps}, {self.max_steps}]"
            )
        if not self.mtbf_prior_s > 0:
            raise ValueError(f"mtbf_prior_s must be > 0, got {self.mtbf_prior_s}")


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The optimal time between checkpoints, sqrt(2 x C x MTBF), seconds."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


def interval_steps(
    *, cost_s: float, persist_s: float, step_s: float, mtbf_s: float, config: IntervalConfig
) -> int:
    """Young/Daly in steps, at least the persist time, within the config's bounds."""
    if not step_s > 0:
        return config.initial_steps
    seconds = max(young_daly_s(cost_s, mtbf_s), persist_s)
    return min(config.max_steps, max(config.min_steps, math.ceil(seconds / step_s)))


class AdaptiveInterval:
    """When the next durable save is due; identical on every rank by construction."""

    def __init__(
        self,
        config: IntervalConfig,
        *,
        state_dir: Path | None = None,
        ledger: Recorder = NULL,
        relaunched: bool = False,
    ) -> None:
        """``relaunched``: this process replaces one that failed (a launcher restart), a
        failure on top of those persisted; ``restarted()`` counts in-process ones."""
        self.config = config
        self.ledger = ledger
        self.path = None if state_dir is None else state_dir / STATE_FILE
        self.steps = config.initial_steps
        self.failures = 0
        self.train_s = 0.0
        if self.path is not None:
            self._load(self.path)
        self.failures += int(relaunched)
        self.next_step: int | None = None
        self.step_s = 0.0  # mean step time, no save persisting
        self.busy_step_s = 0.0  # mean step time while a save persisted
        self.busy_steps = 0
        self.blocking_s = 0.0
        self.persist_s = 0.0

    # --- the loop's calls --------------------------------------------------------------------
    def start(self, first_step: int) -> None:
        """An iteration begins at ``first_step`` (after a restore): the next save is one
        interval later."""
        self.next_step = first_step + self.steps - 1

    def restarted(self) -> None:
        """A fault ended the previous iteration of this process."""
        self.failures += 1

    def due(self, step: int) -> bool:
        assert self.next_step is not None, "call start() first"
        return step >= self.next_step

    def step_time(self, dur_s: float, *, persisting: bool) -> None:
        """A completed step took ``dur_s``; ``persisting``: a save was persisting meanwhile."""
        self.train_s += dur_s
        if persisting:
            self.busy_step_s = _ema(self.busy_step_s, dur_s)
            self.busy_steps += 1
        else:
            self.step_s = _ema(self.step_s, dur_s)

    def saved(
        self,
        step: int,
        *,
        blocking_s: float,
        persist_s: float | None,
        agree: Callable[[Sequence[float]], Sequence[float]],
        write: bool,
    ) -> int:
        """A save of ``step`` was due (and staged, blocking ``blocking_s``, or skipped);
        ``persist_s`` is the last finished persist (None: none yet). Every rank calls this at the same step; ``agree`` returns the element-wise max over
        ranks. Returns the interval from now on; ``write``: persist the state (one rank)."""
        self.blocking_s = _ema(self.blocking_s, blocking_s)
        if persist_s is not None:
            self.persist_s = _ema(self.persist_s, persist_s)
        # What persisting took from training: the steps that ran meanwhile, beyond their speed.
        slow = max(0.0, self.busy_step_s - self.step_s) * self.busy_steps if self.step_s else 0.0
        self.busy_steps = 0
        local = [
            self.blocking_s + slow,
            self.persist_s,
            self.step_s or self.busy_step_s,
            self.train_s,
            float(self.failures),
        ]
        cost_s, persist, step_s, train_s, failures = (float(x) for x in agree(local))
        self.train_s, self.failures = train_s, int(failures)
        mtbf_s = (train_s + self.config.mtbf_prior_s) / (self.failures + 1)
        new = interval_steps(
            cost_s=cost_s, persist_s=persist, step_s=step_s, mtbf_s=mtbf_s, config=self.config
        )
        if new != self.steps:
            self.ledger.emit(
                ev.TUNED,
                name="ckpt_interval_steps",
                value=new,
                previous=self.steps,
                layer="checkpoint",
                step=step,
                cost_s=round(cost_s, 5),
                persist_s=round(persist, 5),
                step_s=round(step_s, 5),
                mtbf_s=round(mtbf_s, 3),
                failures=self.failures,
            )
            self.steps = new
        self.next_step = step + self.steps
        if write:
            self._save()
        return self.steps

    # --- persistence -------------------------------------------------------------------------
    def _save(self) -> None:
        if self.path is None:
            return
        try:
            state = {"failures": self.failures, "train_s": self.train_s, "steps": self.steps}
            write_atomic(self.path, json.dumps(state))
        except OSError as e:
            logger.warning("could not persist the checkpoint interval to %s: %s", self.path, e)

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            failures, train_s, steps = (
                int(raw["failures"]),
                float(raw["train_s"]),
                int(raw["steps"]),
            )
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable checkpoint interval state %s: %s", path, e)
            return
        self.failures = failures
        self.train_s = train_s
        self.steps = min(self.config.max_steps, max(self.config.min_steps, steps))


def _ema(mean: float, value: float) -> float:
    return value if mean == 0.0 else (1 - _EMA) * mean + _EMA * value
