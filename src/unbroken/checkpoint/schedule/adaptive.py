"""The adaptive durable interval as ``Checkpointer.maybe_save`` drives it.

With ``CheckpointConfig.adaptive``, ``maybe_save`` times every step (between its calls), asks
``interval.AdaptiveInterval`` whether a durable save is due, and after each save hands it the
save's blocking time and the newest persist time; the interval moves at saves only, from
figures every rank agrees on (one max-reduction per save over the default process group), so
every rank saves at the same steps.

One policy per checkpoint directory per process, kept across the Checkpointers an in-process
restart makes (a second one on the same directory counts a failure), and across launcher
restarts through its state file (``interval.STATE_FILE`` in the directory; a worker that
``unbroken.run`` says was relaunched, ``node.job``, counts one more failure).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.checkpoint import node
from unbroken.checkpoint.config import CheckpointConfig
from unbroken.checkpoint.persisting.inflight import CheckpointStats
from unbroken.checkpoint.schedule.interval import AdaptiveInterval, IntervalConfig
from unbroken.ledger import Recorder

_policies: dict[Path, AdaptiveInterval] = {}


def interval_config(config: CheckpointConfig) -> IntervalConfig:
    """The adaptive interval's bounds from a Checkpointer's config; ValueError naming them."""
    try:
        return IntervalConfig(
            initial_steps=config.every_steps,
            min_steps=config.adaptive_min_steps,
            max_steps=config.adaptive_max_steps,
            mtbf_prior_s=config.mtbf_prior_s,
        )
    except ValueError as e:
        raise ValueError(
            f"adaptive checkpoint interval: {e} (every_steps is the starting interval; fields "
            "every_steps, adaptive_min_steps, adaptive_max_steps, mtbf_prior_s)"
        ) from None


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise maxima of ``values`` over the default process group's ranks (collective;
    the values themselves without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [float(x) for x in values]
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


class AdaptiveSaves:
    """When ``maybe_save`` saves, with ``CheckpointConfig.adaptive``."""

    def __init__(
        self, root: Path, config: CheckpointConfig, *, ledger: Recorder, rank: int
    ) -> None:
        policy = _policies.get(root)
        if policy is None:
            policy = AdaptiveInterval(
                interval_config(config),
                state_dir=root,
                ledger=ledger,
                relaunched=node.job().relaunched,
            )
            _policies[root] = policy
        else:  # this process made one before: an in-process restart
            policy.ledger = ledger
            policy.restarted()
        self.policy = policy
        self.rank = rank
        self._t0: float | None = None

    @classmethod
    def of(
        cls, root: Path, config: CheckpointConfig, ledger: Recorder, rank: int
    ) -> AdaptiveSaves | None:
        """The adaptive interval of a Checkpointer under ``root`` (None: ``config`` is not
        adaptive)."""
        return cls(root, config, ledger=ledger, rank=rank) if config.adaptive else None

    def due(self, step: int, stats: CheckpointStats) -> bool:
        """``step`` completed (``maybe_save``'s call): is a durable save due?"""
        now = time.monotonic()
        if self._t0 is None:
            self.policy.start(step)
        else:
            persisting = stats.saves > len(stats.persist_s) + stats.failed
            self.policy.step_time(now - self._t0, persisting=persisting)
        self._t0 = now
        return self.policy.due(step)

    def saved(self, step: int, *, blocking_s: float, stats: CheckpointStats) -> None:
        """The due save of ``step`` blocked the trainer ``blocking_s`` (collective)."""
        persisted = stats.persist_s
        self.policy.saved(
            step,
            blocking_s=blocking_s,
            persist_s=persisted[-1] if persisted else None,
            agree=max_over_ranks,
            write=self.rank == 0,
        )
        self._t0 = time.monotonic()
