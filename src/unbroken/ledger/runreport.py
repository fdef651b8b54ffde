"""``RunReport``: every figure of one run, and the categories its time is partitioned into.

``goodput.compute`` makes one; its module docstring is the contract of every figure. Imports
of ours: the ledger's own modules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.ledger.fault_records import FaultRecord
from unbroken.ledger.fault_summary import FaultFigures
from unbroken.ledger.stragglers import Straggler
from unbroken.ledger.unprotected import StorageFailures

# Partition categories in priority order, highest first ("other" is implicit, lowest).
CATEGORIES = (
    "checkpoint_save",
    "checkpoint_load",
    "startup",
    "rendezvous",
    "pg_init",
    "model_build",
    "data",
    "custom",
    "preemption",
    "shutdown",
    "productive",
    "reexecuted",
    "detection",
    "recovery",
)
OTHER = "other"
BADPUT_CATEGORIES = tuple(c for c in CATEGORIES if c != "productive") + (OTHER,)
ML_GOODPUT = {
    "startup": "program_startup",
    "rendezvous": "program_startup",
    "pg_init": "program_startup",
    "model_build": "program_startup",
    "data": "data_loading",
    "checkpoint_save": "checkpoint_save",
    "checkpoint_load": "checkpoint_restore",
    "reexecuted": "wasted_progress",
    "detection": "infrastructure_recovery",
    "recovery": "infrastructure_recovery",
    "custom": "custom_badput_events",
    "preemption": "other",
    "shutdown": "other",
    OTHER: "other",
}
"""Each badput category's name in Google's ml-goodput-measurement (program start-up, data
loading, checkpoint save and restore, wasted progress from disruption, infrastructure recovery
from disruption, custom badput events, other)."""
assert set(ML_GOODPUT) == set(BADPUT_CATEGORIES), "every badput category has an ml-goodput name"


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """Every figure of one run; see the module docstring for the definitions."""

    run: str
    """The run id (most common ``run`` field)."""
    wall_s: float
    """t1 - t0."""
    productive_s: float
    """Seconds of surviving steps not covered by a higher-priority category."""
    steps_completed: int
    """Distinct step numbers with a surviving execution."""
    training_goodput: float
    """productive_s / wall_s."""
    infra_goodput: float
    """1 - union of [detection, resume] per fault / wall_s (shutdown + startup)."""
    availability: float
    """1 - union of [fault, resume] per fault / wall_s (detection included)."""
    checkpoint_efficiency: float | None
    """1 - checkpoint_save_s / loop_s; None if there is no loop time."""
    ettr: float | None
    """productive_s / (wall_s - first-launch startup); None if that is 0."""
    badput_s: dict[str, float]
    """Seconds per non-productive category (all of BADPUT_CATEGORIES)."""
    faults: list[FaultRecord]
    """Faults in the order they were opened."""
    num_attempts: int
    """Distinct launcher attempts seen."""
    num_iterations: int
    """Max in-process iteration + 1."""
    checkpoint_save_s: float
    """Seconds the trainer was blocked by saves."""
    fault_s: float
    """Seconds the faults cost: their windows and re-executed steps, less saves and productive."""
    loop_s: float
    """Measure of the union of reference-rank step and ckpt_stage intervals."""
    step_time_s_median: float | None
    """Median duration of surviving steps."""
    recovery_s_median: float | None
    """Median recovery_s over recovered faults."""
    recovery_s_max: float | None
    """Max recovery_s over recovered faults."""
    by_class: dict[str, FaultFigures] = field(default_factory=dict)
    """Recovery figures per fault class (``fault_summary``)."""
    by_phase: dict[str, FaultFigures] = field(default_factory=dict)
    """Recovery figures per phase the faults fired in (``fault_summary``)."""
    custom_s: dict[str, float] = field(default_factory=dict)
    """Seconds of each user phase (``custom`` badput) on the reference rank, by name."""

    def ml_badput_s(self) -> dict[str, float]:
        """``badput_s`` in other categories.

        Returns:
            Category of Google's ml-goodput-measurement (``ML_GOODPUT``) -> seconds.
        """
        out = dict.fromkeys(dict.fromkeys(ML_GOODPUT.values()), 0.0)
        for category, seconds in self.badput_s.items():
            out[ML_GOODPUT[category]] += seconds
        return out

    step_time_s_outside: float | None = None
    """Median surviving step outside every degradation window; None without a window."""
    degraded_s: float = 0.0
    """What the degradations cost: their windows' steps' time beyond as many undegraded steps."""
    stragglers: list[Straggler] = field(default_factory=list)
    """Straggler episodes, by begin."""
    storage: StorageFailures = field(default_factory=StorageFailures)
    """Failed checkpoint saves and the time the run went unprotected by durable checkpoints."""

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (``unbroken report --json``).

        Returns:
            Field name -> value, nested records as dicts.
        """
        out = asdict(self)
        out["faults"] = [f.to_dict() for f in self.faults]
        out["by_class"] = {k: v.to_dict() for k, v in self.by_class.items()}
        out["by_phase"] = {k: v.to_dict() for k, v in self.by_phase.items()}
        out["stragglers"] = [s.to_dict() for s in self.stragglers]
        out["storage"] = self.storage.to_dict()
        out["badput_s"] = {k: float(v) for k, v in self.badput_s.items()}
        return out
