"""The job a plan is for: ``PlanConfig``, one frozen dataclass, refusing bad values up front.

Fault kinds (``KINDS``) are grouped by the layer that can recover them:

- ``exception``: an error raised in a training process (a NCCL error, a Python exception);
- ``hang``: a collective or the training thread stops progressing;
- ``process``: a training process dies (SIGKILL, OOM kill, segfault);
- ``node``: a machine is lost with every process on it.

Layerings (``LAYERINGS``), each a stack of recovery layers:

- ``inprocess``: in-process restart, the launcher behind it, Kubernetes (or a hot spare) for
  lost nodes: exceptions and hangs stay in the process, crashes go to the launcher;
- ``launcher``: the launcher restarts the workers of every fault short of a lost node;
- ``kubernetes``: every fault fails the job and Kubernetes recreates it from the newest durable
  checkpoint (no memory tier, no hot spare).

Costs are per fault: detection (fault -> noticed), restart (noticed -> training again, before
the restore; per recovering layer), restore (per tier: ``memory`` or ``durable``) and the
rolled-back steps. Defaults are the order of the published 16-H100 run; ``--from RUN_DIR``
replaces them with a real run's measured ones (``measured``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

KINDS = ("exception", "hang", "process", "node")
LAYERINGS = ("inprocess", "launcher", "kubernetes")
LAYERS = ("inprocess", "launcher", "spare", "kubernetes")
TIERS = ("memory", "durable")

DEFAULT_RESTART_S: Mapping[str, float] = MappingProxyType(
    {"inprocess": 8.0, "launcher": 15.0, "spare": 30.0, "kubernetes": 240.0}
)


def _frozen(m: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """One training job and its environment; every duration in seconds, sizes in bytes."""

    nodes: int = 2
    """Nodes of the job."""
    gpus_per_node: int = 8
    """GPUs (ranks) per node."""
    steps: int = 100_000
    """Training steps of the run (the work is fixed; the wall time grows with faults)."""
    step_time_s: float = 1.0
    """Seconds of one training step, without checkpoint stalls."""
    failures_per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    """Failure rate by kind, per GPU per hour (a rate, for a production job)."""
    injected: Mapping[str, int] = field(default_factory=dict)
    """A fixed number of faults by kind instead of rates (a fault-injection run)."""
    state_bytes: float = 16 * 8e9
    """The whole job's checkpoint: model and optimizer state, all ranks together."""
    storage_bytes_per_s: float = 10e9
    """Aggregate durable-storage bandwidth the job's ranks share (write and read)."""
    stage_bytes_per_s: float = 10e9
    """Per GPU: copy of its shard into host memory (an async save's stall, a memory restore)."""
    async_checkpoint: bool = True
    """Durable saves persist in the background (False: the step waits for the write)."""
    ckpt_every_steps: int | None = None
    """Steps between durable checkpoints; None: the best interval (Young/Daly)."""
    memory_tier: bool = True
    """Snapshots in host memory (local, and a peer's copy) that restores use when they survive."""
    memory_every_steps: int | None = None
    """Steps between memory-tier snapshots; None: the best interval."""
    memory_slots: int = 1
    """Copies of its shard each rank's staging arena holds (the Checkpointer's memory_slots)."""
    replica_slots: int = 2
    """Copies of another node's shard each rank's peer replica holds (multi-node jobs)."""
    measured_stall: float | None = None
    """Blocking checkpoint seconds per second of steps, measured; None: from the sizes."""
    save_stage_s: float | None = None
    """Blocking seconds of an async durable save, measured; None: a snapshot's (``stage_s``)."""
    note_s: float = 0.0
    """Blocking seconds of noting a step the memory tier neither saves nor snapshots."""
    startup_s: float = 120.0
    """The job's first start: imports, rendezvous, process group, model build, shutdown."""
    other_overhead: float = 0.0
    """Fraction of step time lost otherwise (logging, data stalls), as a measured run shows."""
    exception_detection_s: float = 1.0
    """An exception is noticed (the rank raises; its peers' collectives fail)."""
    hang_timeout_s: float = 30.0
    """In-process watchdog: no progress for this long is a hang."""
    heartbeat_timeout_s: float = 60.0
    """Launcher: no heartbeat for this long is a hang."""
    collective_timeout_s: float = 600.0
    """Kubernetes only: a hang ends when the peers' collective times out."""
    process_detection_s: float = 1.0
    """A dead process is noticed (its exit, by the launcher or the kubelet)."""
    node_detection_s: float = 30.0
    """A lost node is noticed (rendezvous keep-alive, node controller)."""
    restart_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RESTART_S))
    """Noticed -> training again, before the restore, by recovering layer (``LAYERS``)."""
    restore_s: Mapping[str, float] = field(default_factory=dict)
    """Restore seconds by tier, measured; a tier not given is state size / bandwidth."""
    steps_lost: Mapping[str, float] = field(default_factory=dict)
    """Mean steps rolled back by recovering layer, measured; others follow the intervals."""
    hot_spares: int | None = None
    """Spare nodes waiting to replace a lost one; None: the recommended number."""
    node_repair_s: float = 4 * 3600.0
    """A lost node is back in the pool (repaired or replaced) after this long."""
    spare_target: float = 0.99
    """Recommended spares: a spare is ready for this fraction of node losses."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        positive = ("step_time_s", "state_bytes", "storage_bytes_per_s", "stage_bytes_per_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        durations = (
            "startup_s",
            "exception_detection_s",
            "hang_timeout_s",
            "heartbeat_timeout_s",
            "collective_timeout_s",
            "process_detection_s",
            "node_detection_s",
            "node_repair_s",
            "other_overhead",
            "note_s",
        )
        for name in durations:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.measured_stall is not None and not (
            math.isfinite(self.measured_stall) and self.measured_stall >= 0
        ):
            raise ValueError(f"measured_stall must be a number >= 0, got {self.measured_stall!r}")
        if self.save_stage_s is not None and not (
            isinstance(self.save_stage_s, (int, float))
            and math.isfinite(self.save_stage_s)
            and self.save_stage_s >= 0
        ):
            raise ValueError(
                f"save_stage_s must be a number >= 0 or None, got {self.save_stage_s!r}"
            )
        if not 0 < self.spare_target < 1:
            raise ValueError(f"spare_target must lie in (0, 1), got {self.spare_target!r}")
        if self.memory_slots < 1 or self.replica_slots < 0:
            raise ValueError(
                f"memory_slots must be >= 1 and replica_slots >= 0, got {self.memory_slots} "
                f"and {self.replica_slots}"
            )
        for name in ("ckpt_every_steps", "memory_every_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {value!r}")
        if self.hot_spares is not None and (
            not isinstance(self.hot_spares, int) or self.hot_spares < 0
        ):
            raise ValueError(f"hot_spares must be a whole number >= 0, got {self.hot_spares!r}")
        if self.failures_per_gpu_hour and self.injected:
            raise ValueError(
                "give failures_per_gpu_hour (a production job's rates) or injected (a fault "
                "count), not both"
            )
        self._check_map("failures_per_gpu_hour", KINDS, whole=False)
        self._check_map("injected", KINDS, whole=True)
        self._check_map("restart_s", LAYERS, whole=False)
        self._check_map("restore_s", TIERS, whole=False)
        self._check_map("steps_lost", LAYERS, whole=False)
        missing = [layer for layer in LAYERS if layer not in self.restart_s]
        if missing:
            raise ValueError(
                f"restart_s has no value for {missing}; give every layer of {list(LAYERS)}"
            )

    def _check_map(self, name: str, keys: tuple[str, ...], *, whole: bool) -> None:
        value = getattr(self, name)
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping of {list(keys)} to numbers, got {value!r}")
        for key, v in value.items():
            if key not in keys:
                raise ValueError(f"{name}: unknown key {key!r}; expected one of {list(keys)}")
            ok = isinstance(v, int) if whole else isinstance(v, (int, float))
            if not ok or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                kind = "a whole number" if whole else "a number"
                raise ValueError(f"{name}[{key!r}] must be {kind} >= 0, got {v!r}")
        object.__setattr__(self, name, _frozen(value))

    # --- derived sizes ---------------------------------------------------------------------
    @property
    def gpus(self) -> int:
        """GPUs in the job: nodes x GPUs per node."""
        return self.nodes * self.gpus_per_node

    @property
    def memory_tier_bytes_per_node(self) -> float:
        """Host memory the memory tier takes on one node: every rank's arena, and in a
        multi-node job the replica of the previous node's ranks."""
        if self.nodes > 1:  # the peer tier: a ring of at least two (CheckpointConfig.lean)
            slots = max(2, self.memory_slots) + self.replica_slots
        else:
            slots = self.memory_slots
        return slots * self.shard_bytes * self.gpus_per_node

    @property
    def shard_bytes(self) -> float:
        """One GPU's share of the state."""
        return self.state_bytes / self.gpus

    @property
    def persist_s(self) -> float:
        """One durable save's write: every shard through the shared bandwidth."""
        return self.state_bytes / self.storage_bytes_per_s

    @property
    def stage_s(self) -> float:
        """One snapshot's copy of a shard into host memory (the async stall)."""
        return self.shard_bytes / self.stage_bytes_per_s

    @property
    def stop_grace_s(self) -> float:
        """The grace period a graceful preemption needs (``--ft-stop-grace-s``, Kubernetes'
        ``terminationGracePeriodSeconds``): the ranks stop two steps, and at least a second,
        after the first one hears SIGTERM (``unbroken.checkpoint.preempt``: ``MARGIN``,
        ``REACH_S``), then stage and persist one durable save; doubled, for a step or a write
        slower than planned."""
        return 2.0 * (max(2 * self.step_time_s, 1.0) + self.stage_s + self.persist_s)

    @property
    def productive_s(self) -> float:
        """Seconds of steps the job needs without faults or overheads."""
        return self.steps * self.step_time_s

    def rate_per_s(self, kind: str) -> float:
        """How often a kind of fault strikes the job (rate mode).

        Args:
            kind: One of ``KINDS``.

        Returns:
            Faults of ``kind`` per second of the job's training time (0 for a kind without a
                rate).
        """
        return self.failures_per_gpu_hour.get(kind, 0.0) * self.gpus / 3600.0


def merge_fields(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a run's measured fields) with the flags' ``given`` over it: a given rate
    replaces the run's injected faults unless faults are given too; restart costs merge."""
    fields = dict(base)
    if given.get("failures_per_gpu_hour") and "injected" not in given:
        fields.pop("injected", None)  # a production rate replaces the run's injected faults
    if "restart_s" in given:
        given = given | {"restart_s": dict(fields.get("restart_s", {})) | given["restart_s"]}
    fields |= given
    if "restart_s" in fields:
        fields["restart_s"] = dict(PlanConfig().restart_s) | fields["restart_s"]
    return fields


def failures_per_gpu_hour(interruptions: float, *, days: float, gpus: int) -> float:
    """A published interruption count over a run, as a rate per GPU-hour (Llama 3: 466 in 54
    days on 16,384 GPUs)."""
    if interruptions < 0 or days <= 0 or gpus < 1:
        raise ValueError(
            f"need interruptions >= 0, days > 0 and gpus >= 1; got {interruptions}, {days}, {gpus}"
        )
    return interruptions / (days * 24.0 * gpus)
