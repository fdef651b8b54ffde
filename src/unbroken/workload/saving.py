"""When the reference script saves: every ``--ckpt-every`` steps, or at the adaptive interval.

``--ckpt-adaptive`` (opt-in) hands the choice to the Checkpointer's adaptive interval
(``CheckpointConfig.adaptive``: Young/Daly from the measured save cost and failure rate, within
``--ckpt-min-every`` and ``--ckpt-max-every``). Opt-in because the benchmarks and the demo
compare configurations at a fixed interval, and because the failure rate it needs is only an
assumption (``--ckpt-mtbf-s``) until the job has seen failures.

What failing storage does (``CheckpointConfig.on_storage_failure``): ``--ckpt-persist-timeout-s``,
``--on-storage-failure``, ``--storage-retry-s``, ``--storage-failure-limit-s``.
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
    p.add_argument(
        "--ckpt-persist-timeout-s",
        type=float,
        default=600.0,
        help="a save not durable this long after staging is failed as stalled storage",
    )
    p.add_argument(
        "--on-storage-failure",
        choices=["continue", "stop"],
        default="continue",
        help="failing checkpoint storage: train on from memory snapshots and retry (continue), "
        "or stop the job once it failed for --storage-failure-limit-s and a final save failed",
    )
    p.add_argument(
        "--storage-retry-s",
        type=float,
        default=10.0,
        help="after a failed save, hold durable saves back this long (doubling per failure)",
    )
    p.add_argument(
        "--storage-failure-limit-s",
        type=float,
        default=3600.0,
        help="with --on-storage-failure stop: how long storage may fail before the final save",
    )


def checkpointer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The Checkpointer's storage and adaptive-interval fields from the flags; ValueError
    naming the flags when they do not fit together."""
    storage = {
        "persist_timeout_s": args.ckpt_persist_timeout_s,
        "on_storage_failure": args.on_storage_failure,
        "storage_retry_s": args.storage_retry_s,
        "storage_retry_max_s": max(600.0, args.storage_retry_s),
        "storage_failure_limit_s": args.storage_failure_limit_s,
    }
    try:
        CheckpointConfig(**storage)
    except ValueError as e:
        raise ValueError(
            f"{e} (flags --ckpt-persist-timeout-s, --on-storage-failure, --storage-retry-s, "
            "--storage-failure-limit-s)"
        ) from None
    if not args.ckpt_adaptive:
        return storage
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
    return {**storage, **fields}
