"""``unbroken doctor``: checks a machine before a job runs on it, and says what to fix.

Each check does the real thing where it can (two gloo ranks all-reduce over a TCPStore, a file
is written, locked and renamed on the checkpoint file system, a memfd is mapped and handed over
a socket, a cpu quota is put on a child cgroup, a port is bound) and returns one ``Check``:
"ok", "warn" (the job runs; something a feature needs is missing), "fail" (the job will not run
as asked) or "skip" (nothing to check without an input). The staging the memory tier needs per
node is ``state_gb`` x ``nproc_per_node`` x the arena's resident regions
(``CheckpointConfig.resident_regions``: its memory slots, 1 without the tier, at least 2 on
more than one node), plus there the 2-region replicas this node keeps of the previous node's
ranks (``unbroken.checkpoint.peers``).

``unbroken doctor`` prints one line per check and exits 0 when none failed, ``EXIT_FAILED``
when one did, 2 on bad input.

The checks, by what they look at: ``backends`` (torch, gloo, CUDA and NCCL), ``memory``
(/dev/shm, the node's memory, memfd), ``storage`` (the checkpoint file system), ``host``
(cgroups, network namespaces, ports, clocks); ``config`` holds ``DoctorConfig`` and ``Check``.

Imports of ours: ``unbroken.env``, ``unbroken.ports``, ``unbroken.checkpoint``, ``unbroken.faults``, ``unbroken.k8s``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from unbroken.checkpoint import CheckpointConfig
from unbroken.doctor.backends import check_cuda, check_gloo, check_torch
from unbroken.doctor.config import EXIT_FAILED, Check, DoctorConfig
from unbroken.doctor.host import check_cgroup, check_clock, check_netns, check_port
from unbroken.doctor.memory import check_memfd, check_memory, check_shm
from unbroken.doctor.storage import check_checkpoint_dir

__all__ = [
    "CHECKS",
    "EXIT_FAILED",
    "Check",
    "DoctorConfig",
    "Report",
    "add_arguments",
    "main",
    "run",
]


@dataclass
class Report:
    """Every check, in order; ``exit_code`` is what ``unbroken doctor`` exits with."""

    checks: list[Check] = field(default_factory=list)
    """The verdicts, in the order they ran."""

    @property
    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if c.status == "fail"]

    @property
    def exit_code(self) -> int:
        """``EXIT_FAILED`` when a check failed, else 0."""
        return EXIT_FAILED if self.failed else 0

    def to_json(self) -> str:
        """The report for machines.

        Returns:
            A JSON object: ``ok`` (nothing failed), ``exit_code``, ``checks``.
        """
        checks = [asdict(c) for c in self.checks]
        return json.dumps({"ok": not self.failed, "exit_code": self.exit_code, "checks": checks})

    def format(self) -> str:
        """The report for people.

        Returns:
            One line per check (status, name, what was found; what to do), then a summary.
        """
        width = max(len(c.name) for c in self.checks)
        lines = []
        for c in self.checks:
            tag = "FAIL" if c.status == "fail" else c.status
            line = f"{tag:<4}  {c.name:<{width}}  {c.found}"
            lines.append(f"{line}  -> {c.fix}" if c.fix else line)
        counts = {s: sum(c.status == s for c in self.checks) for s in ("fail", "warn", "ok")}
        lines.append(
            f"{counts['fail']} failed, {counts['warn']} warning(s), {counts['ok']} ok"
            + (": fix the FAIL lines before the job runs" if counts["fail"] else "")
        )
        return "\n".join(lines)


CHECKS: tuple[tuple[str, Callable[[DoctorConfig], Check]], ...] = (
    ("torch", check_torch),
    ("gloo", check_gloo),
    ("cuda", check_cuda),
    ("shm", check_shm),
    ("memory", check_memory),
    ("memfd", check_memfd),
    ("checkpoint", check_checkpoint_dir),
    ("cgroup", check_cgroup),
    ("netns", check_netns),
    ("port", check_port),
    ("clock", check_clock),
)
"""Every check by name, in the order ``unbroken doctor`` prints them."""
_NEEDS_TORCH = ("gloo", "cuda")


def run(cfg: DoctorConfig) -> Report:
    """Run every check of ``CHECKS`` on this machine for the job ``cfg`` describes.

    Args:
        cfg: what the job needs (state size, ranks, checkpoint directory, port).

    Returns:
        The report; a check that raised is a "fail" naming the error, never an exception.
    """
    report = Report()
    for name, check in CHECKS:
        if name in _NEEDS_TORCH and report.checks[0].status == "fail":
            report.checks.append(Check(name, "skip", "torch is not usable", ""))
            continue
        try:
            report.checks.append(check(cfg))
        except Exception as e:  # a check that breaks is a finding, not a traceback
            report.checks.append(
                Check(name, "fail", f"the check itself failed: {e!r}", "report this error")
            )
    return report


def add_arguments(p: Any) -> None:
    """The flags of ``unbroken doctor``, one per ``DoctorConfig`` field.

    Args:
        p: The subcommand's argparse parser.
    """
    p.add_argument(
        "--state-gb",
        type=float,
        default=0.0,
        help="checkpoint state of one rank in GB (model + optimizer): sizes the staging and "
        "the checkpoint space (default 0: not sized)",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes of the job (default 1; more adds peer replicas to the staging)",
    )
    p.add_argument(
        "--memory-slots",
        type=int,
        default=CheckpointConfig.memory_slots,
        help="the Checkpointer's memory_slots (default %(default)s)",
    )
    p.add_argument(
        "--no-memory-tier",
        dest="memory_tier",
        action="store_false",
        help="the job runs without the memory tier (one staging region per rank)",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=CheckpointConfig.keep,
        help="the Checkpointer's keep: committed checkpoints on disk (default %(default)s)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="the checkpoint directory: checked for a commit (write, fsync, rename), flock "
        "and free space",
    )
    p.add_argument(
        "--port", type=int, default=None, help="a port the job binds (rendezvous): checked free"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: Any) -> int:
    """``unbroken doctor``: print the report.

    Args:
        args: The parsed flags (``add_arguments``).

    Returns:
        The exit code: ``Report.exit_code``.

    Raises:
        ValueError: a flag's value is out of range (the CLI prints it, exit code 2).
    """
    cfg = DoctorConfig(
        state_gb=args.state_gb,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        memory_tier=args.memory_tier,
        memory_slots=args.memory_slots,
        keep=args.keep,
        checkpoint_dir=args.checkpoint_dir,
        port=args.port,
    )
    report = run(cfg)
    print(report.to_json() if args.json else report.format())
    return report.exit_code
