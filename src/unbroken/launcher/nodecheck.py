"""Node health checks before a rendezvous: a node that fails one is kept out of the job.

``unbroken-run --ft-node-checks checkpoint,shm,clock`` runs those checks of ``unbroken doctor``
(``LauncherConfig.node_checks``: the ones that look at this machine alone) before the agent
joins a round. All pass (or only warn): the node joins. One fails: the agent records the
checks (a ``node_check`` phase in the ledger), writes the error file (cause ``node_check``,
category ``platform``) and exits ``EXIT_NODE_UNHEALTHY`` (7) without joining, so that the
round forms without it; on Kubernetes the pod fails and its index is replaced (or a hot spare
takes its place), like NVIDIA's resiliency extension's node health check.

Imports of ours: ``unbroken.doctor`` (on use), ``unbroken.launcher.config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Verdict:
    """One node check's outcome (``unbroken.doctor.Check``, flattened for the ledger)."""

    name: str
    status: str
    found: str
    fix: str

    def line(self) -> str:
        """The verdict for a log line: status, name, what was found; what to do."""
        return f"{self.status} {self.name}: {self.found}" + (f" -> {self.fix}" if self.fix else "")


def run(
    names: tuple[str, ...], *, nproc_per_node: int, nnodes: int, checkpoint_dir: Path | None
) -> list[Verdict]:
    """Run the named checks of ``unbroken doctor`` on this machine, in ``names``' order.

    Args:
        names: Check names (``config.NODE_CHECKS``).
        nproc_per_node: This node's ranks (the staging ``shm`` and ``memory`` size for).
        nnodes: The job's nodes (more than one: peer replicas to stage too).
        checkpoint_dir: Where checkpoints go (the ``checkpoint`` check).

    Returns:
        One verdict per check; a check that raised is a "fail" naming the error.
    """
    from unbroken import doctor

    cfg = doctor.DoctorConfig(
        nproc_per_node=nproc_per_node, nnodes=nnodes, checkpoint_dir=checkpoint_dir
    )
    checks = dict(doctor.CHECKS)
    out = []
    for name in names:
        try:
            c = checks[name](cfg)
            out.append(Verdict(name, c.status, c.found, c.fix))
        except Exception as e:  # a check that breaks is a finding, not a traceback
            out.append(Verdict(name, "fail", f"the check itself failed: {e!r}", "report this"))
    return out


def failed(verdicts: list[Verdict]) -> list[Verdict]:
    """The verdicts that keep the node out of the job."""
    return [v for v in verdicts if v.status == "fail"]


def to_ledger(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    """The verdicts as ledger data."""
    return [{"name": v.name, "status": v.status, "found": v.found} for v in verdicts]
