"""What a job needs (``DoctorConfig``, one field per flag) and one check's verdict (``Check``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unbroken.checkpoint import CheckpointConfig

Status = Literal["ok", "warn", "fail", "skip"]
EXIT_FAILED = 3
"""Exit code of ``unbroken doctor`` when a check failed (1 is an uncaught error, 2 bad input)."""
GB = 1e9
PEER_REGIONS = 2
"""Regions of a peer replica: the two newest snapshots of each rank of the previous node."""
GLOO_TIMEOUT_S = 20.0


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    """What the job will need; every field maps to a flag of ``unbroken doctor``."""

    state_gb: float = 0.0
    """Checkpoint state of one rank (model, optimizer, extras) in GB (1e9 bytes); 0: the
    staging and the checkpoint space are not sized."""
    nproc_per_node: int = 1
    """Ranks on this node (``unbroken-run --nproc-per-node``)."""
    nnodes: int = 1
    """Nodes of the job: more than one adds the peer replicas to this node's staging."""
    memory_tier: bool = True
    """The Checkpointer's ``memory_tier`` (False: one staging region per rank)."""
    memory_slots: int = CheckpointConfig.memory_slots
    """The Checkpointer's ``memory_slots``: staging regions per rank with the memory tier."""
    keep: int = CheckpointConfig.keep
    """The Checkpointer's ``keep``: committed checkpoints on disk (one more is being written)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go (the Checkpointer's directory); None: not checked."""
    port: int | None = None
    """A port the job binds (``--rdzv-endpoint``/``--master-port``); None: only port 0."""
    gloo_timeout_s: float = GLOO_TIMEOUT_S
    """The two-rank gloo probe fails after this long."""

    def __post_init__(self) -> None:
        if not 0 <= self.state_gb < float("inf"):
            raise ValueError(f"--state-gb must be a finite number >= 0, got {self.state_gb}")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.gloo_timeout_s > 0:
            raise ValueError(f"gloo_timeout_s must be > 0, got {self.gloo_timeout_s}")
        if self.checkpoint_dir is not None and not str(self.checkpoint_dir):
            raise ValueError("--checkpoint-dir must not be empty")
        try:
            self.checkpoint_config()
        except ValueError as e:
            raise ValueError(f"{e} (--memory-slots, --keep, --no-memory-tier)") from e

    def checkpoint_config(self) -> CheckpointConfig:
        """The Checkpointer settings the staging and the disk space are sized for.

        Returns:
            The settings, with the tier's slots (1 region without the tier; at least 2 on more
            than one node, where the peer tier holds a rank's one too) and ``keep``.

        Raises:
            ValueError: ``memory_slots`` or ``keep`` out of range (as the Checkpointer says).
        """
        slots = self.memory_slots if self.memory_tier else 1
        if self.memory_tier and self.nnodes > 1 and slots >= 1:
            slots = max(2, slots)
        return CheckpointConfig(memory_tier=self.memory_tier, memory_slots=slots, keep=self.keep)

    def staging_bytes(self) -> float:
        """Shared memory this node's ranks stage into.

        Returns:
            Bytes (0 without ``state_gb``).
        """
        per_rank = self.state_gb * GB
        regions = self.checkpoint_config().resident_regions
        if self.memory_tier and self.nnodes > 1:
            regions += PEER_REGIONS
        return per_rank * self.nproc_per_node * regions

    def checkpoint_bytes(self) -> float:
        """Disk the job's checkpoints take at most: ``keep`` committed ones and one being
        written (between saves, the recycled files of a retired one: ``layout``), of every
        rank of every node (the checkpoint file system is shared).

        Returns:
            Bytes.
        """
        return (self.keep + 1) * self.state_gb * GB * self.nproc_per_node * self.nnodes


@dataclass(frozen=True)
class Check:
    """One check's verdict."""

    name: str
    """What was checked (``CHECKS``' names)."""
    status: Status
    """"ok", "warn", "fail" or "skip"."""
    found: str
    """What the check saw."""
    fix: str = ""
    """What to do about it ("" when nothing)."""


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"
