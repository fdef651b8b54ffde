"""``unbroken bench recovery``'s recovery figures per fault class and per phase.

Each configuration's figures are over the faults of all its runs (its ``--repeat`` rounds
pooled: a p95 over five rounds' faults, not a median of five p95s); the ledger's
``fault_summary`` defines them. Each run's own figures are in its JSON row (``by_class``,
``by_phase``, from its report).
"""

from __future__ import annotations

from collections.abc import Callable

from unbroken.bench.recovery_table import ConfigResult
from unbroken.ledger.fault_records import FaultRecord
from unbroken.ledger.fault_summary import FaultFigures, by_class, by_phase
from unbroken.ledger.report import fault_group_table


def faults_per_config(results: list[ConfigResult]) -> dict[str, list[FaultRecord]]:
    """Every configuration that had faults -> the faults of all its runs, in run order."""
    out: dict[str, list[FaultRecord]] = {}
    for r in results:
        faults = [FaultRecord.from_dict(f) for f in r.figures.get("faults", [])]
        if faults:
            out.setdefault(r.config, []).extend(faults)
    return out


def _section(
    title: str,
    key: str,
    per_config: dict[str, list[FaultRecord]],
    group: Callable[[list[FaultRecord]], dict[str, FaultFigures]],
) -> list[str]:
    rows = [
        ((config, name), g)
        for config, faults in per_config.items()
        for name, g in group(faults).items()
    ]
    return [title, *fault_group_table(("config", key), rows)]


def format_fault_classes(results: list[ConfigResult]) -> str:
    """Two tables, recovery per fault class and per phase, one row per configuration and group
    ('' when no run had a fault)."""
    per_config = faults_per_config(results)
    if not per_config:
        return ""
    pooled = any(r.run > 1 for r in results)
    suffix = " (each configuration's runs pooled)" if pooled else ""
    lines = _section(f"recovery per fault class{suffix}", "class", per_config, by_class)
    lines.append("")
    lines += _section(f"recovery per phase{suffix}", "phase", per_config, by_phase)
    return "\n".join(lines)
