"""The deterministic fault plan: what fires, where, when.

A plan is YAML (or the equivalent dict)::

    faults:
      - {step: 12, rank: 1, kind: sigkill}
      - {step: 30, rank: 0, kind: exception}

Each entry fires once per run, after the given rank completes the given step (in the step hook,
before that step's checkpoint), even across restarts. Extra keys of an entry are
kind-specific parameters and are kept in ``params``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# kind -> what it does (shown by `unbroken faults show`)
KINDS: dict[str, str] = {
    "exception": "raise InjectedFault in the training loop",
    "sigkill": "the rank's process kills itself with SIGKILL",
    "sigterm": "the rank's process sends itself SIGTERM",
    "hang": "the rank stops making progress (a Python loop that never returns)",
}


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One planned fault."""

    index: int
    """Position in the plan; names the fault in the fired record."""
    step: int
    """Fires after this step completes on ``rank``."""
    rank: int
    """Global rank that suffers the fault."""
    kind: str
    """One of KINDS."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific parameters (extra keys of the entry)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"fault #{self.index}: unknown kind {self.kind!r}; valid kinds: {', '.join(KINDS)}"
            )
        if self.step < 0:
            raise ValueError(f"fault #{self.index}: step must be >= 0, got {self.step}")
        if self.rank < 0:
            raise ValueError(f"fault #{self.index}: rank must be >= 0, got {self.rank}")

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.params.items()))
        return f"#{self.index}: step {self.step}, rank {self.rank}: {self.kind}{extra}"


@dataclass(frozen=True)
class FaultPlan:
    """An ordered list of faults (by step, then rank, then plan order)."""

    faults: tuple[FaultSpec, ...] = ()

    def at(self, step: int, rank: int) -> list[FaultSpec]:
        """Faults planned for ``rank`` after ``step``."""
        return [f for f in self.faults if f.step == step and f.rank == rank]

    def check_world(self, world_size: int) -> None:
        """Raise ValueError if a fault targets a rank outside the world."""
        for f in self.faults:
            if f.rank >= world_size:
                raise ValueError(
                    f"fault {f.describe()} targets rank {f.rank}, but the world has "
                    f"{world_size} ranks; fix the plan or the world size"
                )

    def __len__(self) -> int:
        return len(self.faults)


_REQUIRED = ("step", "rank", "kind")


def parse_plan(obj: Any, *, source: str = "plan") -> FaultPlan:
    """Build a plan from parsed YAML; raises ValueError naming the bad entry."""
    if obj is None:
        return FaultPlan()
    if not isinstance(obj, Mapping) or "faults" not in obj:
        raise ValueError(f"{source}: expected a mapping with a 'faults' list, got {obj!r:.80}")
    unknown = set(obj) - {"faults"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level keys {sorted(unknown)}; expected 'faults'")
    entries = obj["faults"] or []
    if not isinstance(entries, list):
        raise ValueError(f"{source}: 'faults' must be a list, got {type(entries).__name__}")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{source}: fault #{i} must be a mapping, got {entry!r:.80}")
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            raise ValueError(f"{source}: fault #{i} lacks {missing}; each needs step, rank, kind")
        for key in ("step", "rank"):
            if not isinstance(entry[key], int) or isinstance(entry[key], bool):
                raise ValueError(
                    f"{source}: fault #{i}: {key} must be an integer, got {entry[key]!r}"
                )
        params = {k: v for k, v in entry.items() if k not in _REQUIRED}
        specs.append(
            FaultSpec(
                index=i,
                step=entry["step"],
                rank=entry["rank"],
                kind=str(entry["kind"]),
                params=params,
            )
        )
    specs.sort(key=lambda f: (f.step, f.rank, f.index))
    return FaultPlan(tuple(specs))


def load_plan(path: str | Path) -> FaultPlan:
    """Read a YAML plan; raises ValueError (bad content) or FileNotFoundError."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"fault plan {p} does not exist")
    try:
        obj = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    return parse_plan(obj, source=str(p))
