"""The reference script's run directory: this job's identity, its default run directory, and
the claims on it and on the checkpoint directory (``unbroken.ledger.owner``).

Semantics (also in ``unbroken.workload.train``): every process of one job shares one identity,
stable across its restarts, so a restart continues the run; another job is refused a directory
that one is using, and one another job used before unless ``--resume`` continues that run on
purpose. The ledger therefore never merges two runs into one wall time by accident.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import time
from pathlib import Path

from unbroken.env import WorkerEnv
from unbroken.ledger.owner import Claim, claim


def _start_ticks(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot ("" when unknown): with the
    pid, it names one process for the life of the machine."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def job_identity(env: WorkerEnv) -> str:
    """The identity every process of this job shares, the same across its restarts.

    The launcher's run id (``UNBROKEN_RUN_ID``, ``TORCHELASTIC_RUN_ID``) when it has one; under
    torchrun without one (``--rdzv-id`` left at "none"): on one node, the agent that started
    the workers (their parent process), across nodes its master address; a process started
    by hand is a job of its own."""
    if env.run_id and env.run_id != "none":
        return env.run_id
    host = socket.gethostname()
    if env.launched and env.local_world_size == env.world_size:
        parent = os.getppid()
        return f"torchrun-{host}-p{parent}-{_start_ticks(parent)}"
    if env.launched:
        return f"torchrun-{env.master_addr}-{env.master_port}"
    return f"{host}-p{os.getpid()}-{_start_ticks(os.getpid())}"


def default_run_dir(env: WorkerEnv) -> Path:
    """``runs/<identity>`` for a launched job (every restart continues the same run), else a
    new directory per process."""
    if env.launched or (env.run_id and env.run_id != "none"):
        return Path("runs") / re.sub(r"[^A-Za-z0-9._-]", "_", job_identity(env))
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-p{os.getpid()}"


def claim_dirs(args: argparse.Namespace, run_dir: Path) -> list[Claim]:
    """Claim the run directory (and the checkpoint directory) for this job; DirectoryOwned
    when another job has them (see the module docstring)."""
    claims = [
        claim(
            run_dir,
            job=args.job,
            takeover=args.resume,
            hint="pass --resume to continue that run on purpose, or choose a new --run-dir",
        )
    ]
    if args.ckpt_every:
        try:
            claims.append(
                claim(
                    Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "ckpt",
                    job=args.job,
                    takeover=True,  # another run's checkpoints: refused at restore
                )
            )
        except BaseException:
            claims[0].release()
            raise
    return claims
