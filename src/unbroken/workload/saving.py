"""When the reference script saves: every ``--ckpt-every`` steps, or at the adaptive interval.

``--ckpt-adaptive`` (opt-in) hands the choice to the Checkpointer's adaptive interval
(``CheckpointConfig.adaptive``: Young/Daly from the measured save cost and failure rate, within
``--ckpt-min-every`` and ``--ckpt-max-every``). Opt-in because the benchmarks and the demo
compare configurations at a fixed interval, and because the failure rate it needs is only an
assumption (``--ckpt-mtbf-s``) until the job has seen failures.
"""

from __future__ import annotations

import argparse
from typing import Any

from unbroken.checkpoint import CheckpointConfig


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


def checkpointer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The Checkpointer's adaptive-interval fields from the flags; ValueError naming the
    flags when they do not fit together."""
    if not args.ckpt_adaptive:
        return {}
    if args.ckpt_every == 0:
        raise ValueError("--ckpt-adaptive needs --ckpt-every N (the starting interval)")
    fields = {
        "adaptive": True,
        "adaptive_min_steps": args.ckpt_min_every,
        "adaptive_max_steps": args.ckpt_max_every,
        "mtbf_prior_s": args.ckpt_mtbf_s,
    }
    try:
        CheckpointConfig(every_steps=args.ckpt_every, **fields)
    except ValueError as e:
        raise ValueError(
            f"--ckpt-adaptive: {e} (flags --ckpt-every, --ckpt-min-every, --ckpt-max-every, "
            "--ckpt-mtbf-s)"
        ) from None
    return fields
