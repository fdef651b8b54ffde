"""Memory snapshots between durable saves, at a cost proportional to the step.

With ``CheckpointConfig.snapshot_every`` 0 and a ``snapshot_budget`` (the default, with the
memory tier), ``Checkpointer.maybe_save`` snapshots between durable saves every ``interval``
steps: the fewest steps whose snapshot blocks the trainer for at most ``snapshot_budget`` of
their time, ``ceil(stall / (budget x step))``. The stall is the larger of the last durable
save's (a snapshot copies what a save copies) and of the snapshots' since it (their agreement
with the other ranks waits on the slowest), the step the median of the newest steps (the time between
``maybe_save`` calls); both are maxima over the ranks, agreed at every durable save (one
all-reduce on every rank at the same step), so every rank snapshots the same steps. A
millisecond step of a small model pays as little as a two-second step of a large one.

Before the first durable save, ``WARMUP`` steps are timed and the next two are snapshotted (the
*probes*; the first one's stall holds the arena's allocation): the lesser stall and the median
step set the interval from there, so a job whose first durable save is far off (or an
in-process restart's new Checkpointer, which measures again) is protected from a lost process
long before it. No probe when the durable interval is at most ``2 * WARMUP`` (the first save
comes soon enough). When the interval would reach the next durable save, nothing is
snapshotted in between (a soft fault still restores the step it interrupted: the note and
``rescue``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

from unbroken.checkpoint.config import CheckpointConfig

SAMPLES = 64
"""Step times kept for the median (the newest)."""

WARMUP = 8
"""Steps timed before the probe snapshots (see the module docstring)."""


def interval(stall_s: float, step_s: float, budget: float) -> int | None:
    """Steps between snapshots so that one snapshot's stall is at most ``budget`` of their time.

    Args:
        stall_s: Seconds one snapshot blocks the trainer.
        step_s: Seconds of one step.
        budget: The share of step time snapshots may take (0.01: 1%).

    Returns:
        At least 1; None without a step time or a budget.
    """
    if step_s <= 0 or budget <= 0:
        return None
    return max(1, math.ceil(stall_s / (budget * step_s)))


class AutoSnapshots:
    """When ``maybe_save`` snapshots between durable saves (see the module docstring).

    Args:
        budget: ``CheckpointConfig.snapshot_budget``.
        every_steps: The durable interval (0: none known; snapshots at any interval).
        agree: Element-wise maxima of a few figures over the ranks (collective).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        budget: float,
        every_steps: int,
        agree: Callable[[Sequence[float]], list[float]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget = budget
        self._clock = clock
        self.every_steps = every_steps
        self._agree = agree
        self._steps: deque[float] = deque(maxlen=SAMPLES)
        self._t0: float | None = None
        self.interval: int | None = None
        """Steps between snapshots now (None: none between durable saves)."""
        self.anchor: int | None = None
        """The step of the last durable save (snapshots count from it)."""
        self._probes: list[float] = []
        self._snapshot_stall = 0.0
        """The longest stall of a snapshot since the last durable save."""

    @classmethod
    def of(
        cls, config: CheckpointConfig, agree: Callable[[Sequence[float]], list[float]]
    ) -> AutoSnapshots | None:
        """The policy of a Checkpointer with ``config`` (None: a fixed ``snapshot_every``, no
        budget or no memory tier)."""
        auto = config.snapshot_every == 0 and config.snapshot_budget > 0 and config.memory_tier
        return cls(config.snapshot_budget, config.every_steps, agree) if auto else None

    def step(self, step: int) -> bool:
        """``maybe_save`` was called for ``step`` (the time since its last call was one step):
        is a snapshot due, unless the step is a durable save's?"""
        now = self._clock()
        if self._t0 is not None:
            self._steps.append(now - self._t0)
        self._t0 = now
        if self.anchor is None:
            return self.probing
        if self.interval is None:
            return False
        since = step - self.anchor
        return since > 0 and since % self.interval == 0

    @property
    def probing(self) -> bool:
        """A probe is due: no durable save yet, ``WARMUP`` steps timed, and the durable
        interval long enough (or none)."""
        far = not self.every_steps or self.every_steps > 2 * WARMUP
        return self.anchor is None and far and len(self._steps) >= WARMUP

    def probed(self, step: int, *, stall_s: float) -> None:
        """The probe of ``step`` blocked ``stall_s``: the second sets the interval from the
        lesser of the two stalls (collective; the first allocated the arena, either may
        have waited on something else)."""
        self._probes.append(stall_s)
        if len(self._probes) > 1:
            self.saved(step, stall_s=min(self._probes))

    def snapshotted(self, step: int, *, stall_s: float) -> None:
        """The snapshot of ``step`` blocked ``stall_s``: a probe's sets the interval
        (``probed``, collective), another's counts in the next one."""
        if self.probing:
            self.probed(step, stall_s=stall_s)
        else:
            self._snapshot_stall = max(self._snapshot_stall, stall_s)

    def saved(self, step: int, *, stall_s: float) -> None:
        """The durable save (or the second probe) of ``step`` blocked ``stall_s``: set the
        interval (collective)."""
        step_s = statistics.median(self._steps) if self._steps else 0.0
        stall_s, self._snapshot_stall = max(stall_s, self._snapshot_stall), 0.0
        stall, step_s = self._agree([stall_s, step_s])
        n = interval(stall, step_s, self.budget)
        within = n is not None and (not self.every_steps or n < self.every_steps)
        self.interval = n if within else None
        self.anchor = step
        self._t0 = self._clock()  # the save's own time is no step's
