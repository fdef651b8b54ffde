"""When the reference script saves: every ``--ckpt-every`` steps, or at the adaptive interval.

``--ckpt-adaptive`` (opt-in) hands the choice to ``unbroken.checkpoint.interval`` (Young/Daly
from the measured save cost and failure rate, within ``--ckpt-min-every`` and
``--ckpt-max-every``). Opt-in because the benchmarks and the demo compare configurations at a
fixed interval, and because the failure rate it needs is only an assumption
(``--ckpt-mtbf-s``) until the job has seen failures. Either way each save is staged inside
``no_hang_protection`` (the in-process watchdog) after a "finishing" heartbeat (the launcher's
step-sized timeout does not apply to a save; the next step's heartbeat ends it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken import heartbeat
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.interval import AdaptiveInterval, IntervalConfig
from unbroken.ledger import Recorder


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt-adaptive",
        action="store_true",
        help="durable interval from measured save costs and failure rate (Young/Daly); "
        "--ckpt-every is the starting interval",
    )
    p.add_argument("--ckpt-min-every", type=int, default=1, help="adaptive: at least N steps")
    p.add_argument("--ckpt-max-every", type=int, default=1000, help="adaptive: at most N steps")
    p.add_argument(
        "--ckpt-mtbf-s",
        type=float,
        default=3600.0,
        help="adaptive: the mean time between failures assumed before any is seen",
    )


def interval_config(args: argparse.Namespace) -> IntervalConfig:
    """The adaptive interval's bounds from the flags; ValueError naming them."""
    try:
        return IntervalConfig(
            initial_steps=args.ckpt_every,
            min_steps=args.ckpt_min_every,
            max_steps=args.ckpt_max_every,
            mtbf_prior_s=args.ckpt_mtbf_s,
        )
    except ValueError as e:
        raise ValueError(
            f"--ckpt-adaptive: {e} (flags --ckpt-every, --ckpt-min-every, --ckpt-max-every, "
            "--ckpt-mtbf-s)"
        ) from None


def policy_for(
    args: argparse.Namespace, *, ckpt_dir: Path, ledger: Recorder, relaunched: bool
) -> AdaptiveInterval | None:
    """The job's adaptive interval (kept across in-process restarts), or None."""
    if not args.ckpt_adaptive:
        return None
    if args.ckpt_every == 0:
        raise ValueError("--ckpt-adaptive needs --ckpt-every N (the starting interval)")
    return AdaptiveInterval(
        interval_config(args), state_dir=ckpt_dir, ledger=ledger, relaunched=relaunched
    )


def _max_over_ranks(device: torch.device) -> Any:
    def agree(values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(x) for x in t.tolist()]

    return agree


class Saver:
    """Saves ``state`` through ``ckpt`` at the due steps of one iteration."""

    def __init__(
        self,
        ckpt: Checkpointer,
        policy: AdaptiveInterval | None,
        *,
        start: int,
        rank: int,
        device: torch.device,
    ) -> None:
        self.ckpt = ckpt
        self.policy = policy
        self.rank = rank
        self._agree = _max_over_ranks(device)
        self._t0 = time.monotonic()
        if policy is not None:
            policy.start(start)

    def step_done(self, step: int, state: Mapping[str, Any], ctx: Any) -> None:
        """Before ``ctx.step_done(step)`` (a fault after step ``step`` finds it staged): save
        if ``step`` is due, else snapshot it to memory if a snapshot is due."""
        policy, ckpt = self.policy, self.ckpt
        if policy is not None:
            now = time.monotonic()
            s = ckpt.stats()
            policy.step_time(now - self._t0, persisting=s.saves > len(s.persist_s) + s.failed)
            self._t0 = now
        if not (ckpt.config.due(step) if policy is None else policy.due(step)):
            if ckpt.config.snapshot_due(step):
                with ctx.no_hang_protection():  # it may wait for the region being persisted
                    ckpt.snapshot(step, state)
            else:  # a soft fault before the next snapshot rescues it (``rescue``)
                ckpt.note(step, state)
            return
        heartbeat(step, committed_step=ckpt.last_committed, finishing=True)
        t0 = time.monotonic()
        with ctx.no_hang_protection():  # a sync save, or one waiting for the last
            ckpt.save(step, state)
        if policy is not None:
            persisted = ckpt.stats().persist_s
            policy.saved(
                step,
                blocking_s=time.monotonic() - t0,
                persist_s=persisted[-1] if persisted else None,
                agree=self._agree,
                write=self.rank == 0,
            )
            self._t0 = time.monotonic()
