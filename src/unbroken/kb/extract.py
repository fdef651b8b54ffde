"""What the knowledge base keeps of one run directory, read from the run's own files.

- configuration: the launcher's ``process_start`` record (its flags, ``--ft-*`` options, restart
  budget, argv, host, versions) and the first reference-rank ``process_start`` (the training
  script's flags: checkpoint interval and mode, timeouts, model, steps; world size, host,
  Python and torch versions), then ``final.json``'s world size, model and seed;
- fault trace: every fault of the ``RunReport`` (kind, rank, step, cause, detector, layer,
  detection and recovery time, steps lost, restore tier) with the detection's error message;
- results: the report's figures, the job's status, ``final_state_sha256``, ``error.json``'s
  reason when the job gave up.

The ledger stays the source of truth: everything here is derived and can be re-ingested.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger import read_run
from unbroken.ledger.goodput import compute

_DROP = {"pid", "dur_s"}


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run as the knowledge base stores it."""

    path: str
    """Absolute path of the run directory (the key: ingesting it again replaces it)."""
    name: str
    """The directory's name."""
    run: str
    """The ledger's run id."""
    started_ts: float
    """Epoch seconds of the run's first record."""
    status: str
    """ok, failed or running (no job_end yet)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Flattened configuration, ``section.key`` -> value."""
    faults: list[dict[str, Any]] = field(default_factory=list)
    """The fault trace, one dict per fault (the report's fields plus ``message``)."""
    results: dict[str, Any] = field(default_factory=dict)
    """The report's figures (faults and badput apart), status and final hash."""
    badput_s: dict[str, float] = field(default_factory=dict)
    """The report's badput breakdown."""


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        out[prefix] = " ".join(str(x) for x in obj)
    elif obj is not None:
        out[prefix] = obj


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def extract(run_dir: str | Path) -> RunRecord:
    """Read one run directory into the record the knowledge base stores.

    Args:
        run_dir: The run directory.

    Returns:
        The run's record.

    Raises:
        FileNotFoundError: When ``run_dir`` is not a directory.
        ValueError: When its ledger has no records yet.
    """
    path = Path(run_dir).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory: pass a job's --run-dir")
    result = read_run(path)
    events = [e for e in result.events if e.kind != ev.ALERT]
    if not events:
        raise ValueError(f"{run_dir}: the ledger has no records yet; ingest it once the job ran")
    report = compute(events)
    config: dict[str, Any] = {}
    launcher = next(
        (e for e in events if e.kind == ev.PROCESS_START and e.rank == ev.LAUNCHER_RANK), None
    )
    worker = next((e for e in events if e.kind == ev.PROCESS_START and e.rank == 0), None)
    for section, rec in (("launcher", launcher), ("train", worker)):
        if rec is not None:
            _flatten(section, {k: v for k, v in rec.data.items() if k not in _DROP}, config)
    final = _read_json(path / "final.json")
    for key in ("world_size", "model", "seed", "steps", "parallel", "global_batch"):
        if key in final:
            config[f"final.{key}"] = final[key]
    messages: dict[float, str] = {}
    for e in events:
        if e.kind == ev.FAULT_DETECTED and e.get("message"):
            messages[e.ts] = str(e.get("message"))
    faults = []
    for f in report.faults:
        d = f.to_dict()
        detected = None if f.detection_s is None else f.fault_ts + f.detection_s
        d["message"] = messages.get(detected, "") if detected is not None else ""
        faults.append(d)
    ends = [e for e in events if e.kind == ev.JOB_END]
    status = (
        "running" if not ends else "ok" if all(e.get("status") == "ok" for e in ends) else "failed"
    )
    results = {k: v for k, v in report.to_dict().items() if k not in ("faults", "badput_s")}
    results["status"] = status
    results["final_state_sha256"] = final.get("final_state_sha256")
    error = _read_json(path / "error.json")
    if error:
        results["error_reason"] = error.get("reason")
        results["error_cause"] = error.get("cause")
    results["torn_lines"] = result.torn_lines
    results["bad_lines"] = len(result.bad_lines)
    return RunRecord(
        path=str(path),
        name=path.name,
        run=report.run,
        started_ts=min(e.begin for e in events) if events else time.time(),
        status=status,
        config=config,
        faults=faults,
        results=results,
        badput_s=dict(report.badput_s),
    )
