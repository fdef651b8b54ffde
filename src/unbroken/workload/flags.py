"""The reference training script's flags (``python -m unbroken.workload.train --help``): the
parser, and the checks that need the world size. Every value is checked where it is parsed
(a finite number, an integer in range), so a bad flag is a usage error, never a fault."""

from __future__ import annotations

import argparse
import contextlib
import math
from typing import Any

from unbroken.checkpoint import CheckpointConfig
from unbroken.workload import model as wmodel
from unbroken.workload import saving

WRITER_PRIORITIES: dict[str, tuple[int, bool]] = {
    "idle": (CheckpointConfig.writer_nice, True),
    "nice": (CheckpointConfig.writer_nice, False),
    "equal": (0, False),
}
"""--writer-priority -> (the writer's niceness, SCHED_IDLE) (``CheckpointConfig``)."""


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        with contextlib.suppress(ValueError):
            if (value := int(text)) >= low:
                return value
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")

    return parse


def _positive(text: str) -> float:
    """A finite number > 0 (nan and inf are refused)."""
    try:
        if math.isfinite(value := float(text)) and value > 0:
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unbroken.workload.train",
        description="unbroken's reference training job (Llama-style model, synthetic language).",
    )
    p.add_argument("--model", default="tiny", help="model size: %(default)s; see SIZES")
    p.add_argument("--steps", type=_int_at_least(0), default=50, help="number of training steps")
    p.add_argument(
        "--batch-size", type=_int_at_least(1), default=8, help="samples per rank per step"
    )
    p.add_argument(
        "--global-batch",
        type=_int_at_least(1),
        default=None,
        help="samples per step across all ranks (overrides --batch-size; must divide evenly)",
    )
    p.add_argument("--seq-len", type=_int_at_least(2), default=64, help="tokens per sample")
    p.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="seed of the model, data and order"
    )
    p.add_argument("--parallel", choices=["fsdp", "ddp", "none"], default="fsdp")
    p.add_argument(
        "--run-dir",
        default=None,
        help="where the ledger and results go (default: runs/<the launcher's run id>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run another job left in --run-dir, restoring its checkpoints",
    )
    p.add_argument("--faults", default=None, help="a fault plan (YAML)")
    p.add_argument("--lr", type=_positive, default=3e-3, help="AdamW learning rate")
    p.add_argument(
        "--num-samples", type=_int_at_least(1), default=1 << 16, help="samples per epoch"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--pg-timeout-s", type=_positive, default=60.0, help="collective timeout")
    p.add_argument(
        "--log-every", type=_int_at_least(1), default=10, help="log the loss every N steps"
    )
    p.add_argument(
        "--no-inprocess",
        action="store_true",
        help="no in-process restart: a fault ends the process (the launcher restarts it)",
    )
    p.add_argument(
        "--soft-timeout-s",
        type=_positive,
        default=None,
        help="no step for this long: restart (default: calibrated from the step times, <= 60 s)",
    )
    p.add_argument(
        "--hard-timeout-s",
        type=_positive,
        default=None,
        help="no step for this long: kill the rank (default: derived from the soft timeout)",
    )
    p.add_argument(
        "--max-rank-faults",
        type=_int_at_least(1),
        default=3,
        help="in-process restart hands over to the launcher once one rank caused this many faults",
    )
    p.add_argument(
        "--ckpt-every",
        type=_int_at_least(0),
        default=0,
        help="checkpoint after every N steps (0: off)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="also snapshot to memory only after every N steps, between checkpoints (0: off)",
    )
    p.add_argument(
        "--no-memory-tier",
        action="store_true",
        help="keep no snapshots in memory: every restore reads the newest checkpoint on disk",
    )
    p.add_argument(
        "--no-rescue",
        action="store_true",
        help="note no step between snapshots: a fault the workers unwind from restores the last "
        "snapshot instead of the step it interrupted (saves ~0.6 ms a step)",
    )
    p.add_argument(
        "--no-peer-replica",
        action="store_true",
        help="in a multi-node unbroken-run job, send no snapshot to another node and fetch "
        "none from one (a lost node's ranks then restore from disk)",
    )
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (<run_dir>/ckpt)")
    p.add_argument("--ckpt-mode", choices=["async", "sync"], default="async")
    p.add_argument(
        "--ckpt-keep", type=_int_at_least(1), default=2, help="committed checkpoints to keep"
    )
    p.add_argument(
        "--ckpt-on-busy",
        choices=["skip", "wait"],
        default="skip",
        help="a save due while the previous one persists: skip it, or wait for the previous",
    )
    p.add_argument(
        "--writer-priority",
        choices=sorted(WRITER_PRIORITIES),
        default="idle",
        help="the checkpoint writer: idle (default: own session at the lowest share, niceness "
        "10, SCHED_IDLE), nice (the same without SCHED_IDLE), equal (the trainer's priority)",
    )
    p.set_defaults(job=None)  # this job's identity, set by main (job_identity)
    saving.add_flags(p)
    return p


def check_args(args: argparse.Namespace, world_size: int) -> int:
    """Validate flags against the world; returns the global batch."""
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.ckpt_every < 0:
        raise ValueError(f"--ckpt-every must be >= 0 (0: no checkpoints), got {args.ckpt_every}")
    if args.snapshot_every < 0:
        raise ValueError(f"--snapshot-every must be >= 0 (0: off), got {args.snapshot_every}")
    if args.snapshot_every and args.no_memory_tier:
        raise ValueError("--snapshot-every needs the memory tier: drop --no-memory-tier")
    wmodel.get_config(args.model)  # ValueError naming the valid sizes
    global_batch = args.global_batch or args.batch_size * world_size
    if global_batch <= 0 or global_batch % world_size:
        raise ValueError(
            f"global batch {global_batch} is not a positive multiple of the world size "
            f"{world_size}; pick --global-batch or --batch-size accordingly"
        )
    return int(global_batch)
