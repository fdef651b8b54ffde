"""A seeded Monte Carlo run of the same job as ``model``, for the spread of the figures.

Each trial trains ``steps`` steps at the model's wall time per step (stall included). Faults
arrive as a Poisson process over training time (rate mode: the kind drawn by its rate, a node
loss finding a spare with the model's probability) or fire once each after a step drawn
uniformly from the run (injected mode). A fault costs the model's detection, restart and
restore, and rolls the job back to the newest snapshot of its tier that exists at that moment:
the last memory snapshot (every ``m`` steps), or the last durable checkpoint (every ``k``
steps) that finished persisting (``lag`` steps after its step). Same intervals, same costs as
the analytical model, so their means agree; the trials show what a run can look like.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

from unbroken.plan.config import KINDS, PlanConfig
from unbroken.plan.model import FaultCost, Prediction, lag_steps, predict


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Percentiles over the trials of one layering.

    Each figure's dict holds p5, p50, p95 and mean.
    """

    layering: str
    """One of ``LAYERINGS``."""
    trials: int
    """Seeded runs simulated."""
    seed: int
    """Their seed."""
    training_goodput: dict[str, float]
    """Training goodput: p5, p50, p95 and mean."""
    infra_goodput: dict[str, float]
    """Infrastructure goodput."""
    faults: dict[str, float]
    """Faults per run."""

    def to_dict(self) -> dict[str, Any]:
        """The spread as plain data (``unbroken plan --json``).

        Returns:
            Field name -> value.
        """
        return {
            "layering": self.layering,
            "trials": self.trials,
            "seed": self.seed,
            "training_goodput": self.training_goodput,
            "infra_goodput": self.infra_goodput,
            "faults": self.faults,
        }


def _percentiles(values: list[float]) -> dict[str, float]:
    xs = sorted(values)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"p5": q(0.05), "p50": q(0.5), "p95": q(0.95), "mean": statistics.fmean(xs)}


def _rollback(completed: int, cost: FaultCost, pred: Prediction, lag: int) -> int:
    """The step count the job resumes from after a fault at ``completed`` steps."""
    if cost.tier == "memory":
        m = pred.memory_every_steps or 1
        return completed - completed % m
    k = pred.ckpt_every_steps
    return max(0, (completed - lag) // k * k) if completed >= lag else 0


class _Trial:
    def __init__(self, cfg: PlanConfig, pred: Prediction, rng: random.Random) -> None:
        self.cfg, self.pred, self.rng = cfg, pred, rng
        self.step_wall = cfg.step_time_s * (1 + pred.stall) * (1 + cfg.other_overhead)
        self.lag = lag_steps(cfg)
        self.train = self.down = self.infra = 0.0
        self.faults = 0

    def _hit(self, cost: FaultCost, done: float) -> float:
        """Account one fault at ``done`` steps (fractional: mid-step); the position after."""
        self.faults += 1
        self.down += cost.detection_s + cost.restart_s + cost.restore_s
        self.infra += cost.restart_s + cost.restore_s
        if cost.layer in self.cfg.steps_lost:  # a measured mean rollback, not the intervals
            self.train += self.cfg.steps_lost[cost.layer] * self.step_wall
            return done
        return float(_rollback(math.floor(done), cost, self.pred, self.lag))

    def rate_mode(self) -> None:
        costs = [c for c in self.pred.costs if c.count > 0]
        weights = [c.count for c in costs]  # a node loss: split by the spare's readiness
        rate = sum(self.cfg.rate_per_s(kind) for kind in KINDS)
        done = 0.0  # steps completed, fractional
        while True:
            left = (self.cfg.steps - done) * self.step_wall
            gap = self.rng.expovariate(rate) if rate > 0 else math.inf
            if gap >= left:
                self.train += left
                return
            self.train += gap  # the partial step in it is lost with the rollback
            done = self._hit(
                self.rng.choices(costs, weights=weights)[0], done + gap / self.step_wall
            )

    def injected_mode(self) -> None:
        plan: list[FaultCost] = []
        for kind, n in self.cfg.injected.items():
            of_kind = [c for c in self.pred.costs if c.kind == kind]
            weights = [c.count for c in of_kind]
            plan += [self.rng.choices(of_kind, weights=weights)[0] for _ in range(n)]
        self.rng.shuffle(plan)
        at_steps = sorted(
            self.rng.sample(range(1, self.cfg.steps), min(len(plan), self.cfg.steps - 1))
        )
        done = 0.0
        for at, cost in zip(
            at_steps, plan, strict=False
        ):  # each fires once, after its step completes
            if at > done:
                self.train += (at - done) * self.step_wall
                done = float(at)
            done = self._hit(cost, done)
        self.train += (self.cfg.steps - done) * self.step_wall

    def figures(self) -> tuple[float, float, int]:
        wall = self.cfg.startup_s + self.train + self.down
        return self.cfg.productive_s / wall, 1 - self.infra / wall, self.faults


def simulate(cfg: PlanConfig, layering: str, *, trials: int = 200, seed: int = 0) -> Spread:
    """Seeded runs of a job under one layering; the same seed, the same figures.

    Args:
        cfg: The job.
        layering: One of ``LAYERINGS``.
        trials: Runs to simulate.
        seed: Their seed.

    Returns:
        Percentiles over the runs.

    Raises:
        ValueError: When ``trials`` < 1, or as ``predict``.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    pred = predict(cfg, layering)
    rng = random.Random(f"{seed}/{layering}")
    train, infra, faults = [], [], []
    for _ in range(trials):
        t = _Trial(cfg, pred, rng)
        if cfg.injected:
            t.injected_mode()
        else:
            t.rate_mode()
        g, i, n = t.figures()
        train.append(g)
        infra.append(i)
        faults.append(float(n))
    return Spread(
        layering=layering,
        trials=trials,
        seed=seed,
        training_goodput=_percentiles(train),
        infra_goodput=_percentiles(infra),
        faults=_percentiles(faults),
    )
