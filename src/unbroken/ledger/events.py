"""The goodput event schema: one record per line, one dataclass for all kinds.

Every record has ``ts`` (epoch seconds), ``run``, ``rank``, ``attempt`` (launcher restarts),
``iteration`` (in-process restarts) and ``kind``. Kind-specific fields live in ``data`` and are
flattened into the JSON object.

Interval convention: a record that carries ``dur_s`` describes the interval
``[ts - dur_s, ts]``; it is written when the interval ends. A process that dies inside an
interval leaves no record of it; the report counts that time by what else covered it
(detection, recovery) or as ``other``.

Rank ``-1`` is a launcher agent (not a training process); rank ``-2`` a watcher (the dashboard),
whose only records are ``alert``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

# --- kinds -----------------------------------------------------------------------------------
PROCESS_START = "process_start"  # ts = the process's creation time; data: pid, host
PHASE = "phase"  # interval; data: name (one of PHASES, or a user's phase: ``phases``)
# Interval from the previous step boundary; data: step, loss, busy_s (the recording thread's
# time on or waiting for a CPU in it: ``busy``).
STEP = "step"
# Interval the trainer was blocked by a save; data: step, bytes, or part: "overlap" (waiting for
# a background copy), "seal" (for a large snapshot's digests, computed after the save),
# "prepare" (for a large arena laid out ahead of the first save), "note"
# (a step noted for a rescue, unbroken.checkpoint.staging.rescue) or "agree" (the ranks agreed
# not to stage: a rank's one snapshot still persisting).
CKPT_STAGE = "ckpt_stage"
CKPT_PERSIST = "ckpt_persist"  # background interval; data: step, bytes, throttle_bytes_per_s
CKPT_COMMIT = "ckpt_commit"  # data: step
CKPT_SKIP = "ckpt_skip"  # data: step, reason[, retried: held back, staged at a later step]
CKPT_FAIL = "ckpt_fail"  # data: step, error
CKPT_LOAD = "ckpt_load"  # interval; data: step (restored, or None), tier ("disk", "memory", "none")
# data: fault (kind), step, index (position in the plan); a degrading one: window_s.
FAULT_INJECTED = "fault_injected"
FAULT_DETECTED = "fault_detected"  # data: cause, detector, layer, fault_rank
RESTART_BEGIN = "restart_begin"  # data: layer, cause
RESTART_END = "restart_end"  # data: layer
WORKER_EXIT = "worker_exit"  # data: exit_code, signal
ESCALATE = "escalate"  # data: reason
JOB_END = "job_end"  # data: status ("ok" | "failed"), final_state_sha256
# A digest of the state a rank holds when its Checkpointer closes (``final_digest``: what a
# benchmark compares across runs). data: step, digest
FINAL_STATE = "final_state"
# A self-tuned setting took a (new) value: a calibrated hang timeout or the adaptive durable
# checkpoint interval. data: name, value, previous (None at first), layer, basis figures.
TUNED = "tuned"
# The job store (the rendezvous store pod) was lost, or re-joined; an agent's record, no goodput
# figure reads it. data: state ("lost" | "rejoined"), endpoint, outage_s (rejoined only).
RDZV_STORE = "rdzv_store"
# An alert raised by a watcher over the ledger (the dashboard); no goodput figure reads it.
# data: name, severity ("info" | "warning" | "page"), key (dedup), summary, labels, value
ALERT = "alert"

KINDS = frozenset(
    {
        PROCESS_START,
        PHASE,
        STEP,
        CKPT_STAGE,
        CKPT_PERSIST,
        CKPT_COMMIT,
        CKPT_SKIP,
        CKPT_FAIL,
        CKPT_LOAD,
        FAULT_INJECTED,
        FAULT_DETECTED,
        RESTART_BEGIN,
        RESTART_END,
        WORKER_EXIT,
        ESCALATE,
        JOB_END,
        TUNED,
        RDZV_STORE,
        ALERT,
        FINAL_STATE,
    }
)

# Phase names of ours: each maps to the badput category of the same name, except "import" ->
# startup. Any other valid name (``phases.check_name``) is a user's phase: badput "custom".
PHASES = frozenset(
    {"import", "rendezvous", "pg_init", "model_build", "data", "shutdown", "preemption"}
)

# Layers that recover a fault.
LAYERS = ("inprocess", "launcher", "orchestrator")

LAUNCHER_RANK = -1
WATCHER_RANK = -2  # a process that only watches the ledger (the dashboard recording alerts)

_COMMON = ("ts", "run", "rank", "attempt", "iteration", "kind")
COMMON_FIELDS = frozenset(_COMMON)
"""The fields every record has; a record's data may not name them."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One ledger record."""

    kind: str
    """What happened; one of KINDS."""
    ts: float = field(default_factory=time.time)
    """Epoch seconds when it happened (the end, for interval records)."""
    run: str = ""
    """The run id, shared by every process of one job."""
    rank: int = 0
    """Global rank of the emitting process; -1 for a launcher agent."""
    attempt: int = 0
    """Launcher restart count of the emitting process."""
    iteration: int = 0
    """In-process restart count of the emitting process."""
    data: dict[str, Any] = field(default_factory=dict)
    """Kind-specific fields (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if not COMMON_FIELDS.isdisjoint(self.data):
            clash = sorted(COMMON_FIELDS.intersection(self.data))
            raise ValueError(f"event data may not redefine common fields: {clash}")

    @property
    def dur_s(self) -> float | None:
        """Length of the interval for interval records (``data["dur_s"]``), else None."""
        d = self.data.get("dur_s")
        return None if d is None else float(d)

    @property
    def begin(self) -> float:
        """Start of the interval for interval records, else ``ts``."""
        d = self.dur_s
        return self.ts - d if d is not None else self.ts

    def get(self, key: str, default: Any = None) -> Any:
        """One kind-specific field.

        Args:
            key: The field's name.
            default: What a record without it gives.

        Returns:
            ``data[key]``, or ``default``.
        """
        return self.data.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """The record as the ledger file holds it.

        Returns:
            The common fields and the kind-specific ones, flat.
        """
        out: dict[str, Any] = {
            "ts": self.ts,
            "run": self.run,
            "rank": self.rank,
            "attempt": self.attempt,
            "iteration": self.iteration,
            "kind": self.kind,
        }
        out.update(self.data)
        return out

    def to_json(self) -> str:
        """The record as one line of the ledger file.

        Returns:
            ``to_dict()`` as compact JSON (values JSON cannot hold as their ``str``).
        """
        return json.dumps(self.to_dict(), separators=(",", ":"), default=str)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Event:
        """Read a record back from its ``to_dict()`` form.

        Args:
            obj: The record.

        Returns:
            The event.

        Raises:
            ValueError: When ``obj`` is not a mapping, or not a known kind.
            KeyError: When it lacks ``kind`` or ``ts``.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"a ledger record is a JSON object, got {type(obj).__name__}")
        data = {k: v for k, v in obj.items() if k not in _COMMON}
        return cls(
            kind=str(obj["kind"]),
            ts=float(obj["ts"]),
            run=str(obj.get("run", "")),
            rank=int(obj.get("rank", 0)),
            attempt=int(obj.get("attempt", 0)),
            iteration=int(obj.get("iteration", 0)),
            data=data,
        )

    @classmethod
    def from_json(cls, line: str) -> Event:
        """Read a record back from one line of a ledger file.

        Args:
            line: The line.

        Returns:
            The event.

        Raises:
            ValueError: When it is not JSON, or not a record (as ``from_dict``).
            KeyError: As ``from_dict``.
        """
        return cls.from_dict(json.loads(line))


def plain_json(
    run_json: str, kind: str, ts: float, rank: int, attempt: int, iteration: int, data: Any
) -> str | None:
    """The record ``Event.to_json`` writes for these fields (``run_json``: the run id as JSON),
    formatted directly, when every value in ``data`` is a finite float, an int, a bool, None or
    a string needing no escape; else None. (The training thread writes its step records
    itself, where the json module costs it tens of microseconds more, run cold.)"""
    parts = [
        f'{{"ts":{ts!r},"run":{run_json},"rank":{rank},"attempt":{attempt},'
        f'"iteration":{iteration},"kind":"{kind}"'
    ]
    for key, value in data.items():
        kind_of = type(value)
        if kind_of is float:
            if not math.isfinite(value):
                return None
            text = repr(value)
        elif kind_of is int:
            text = str(value)
        elif kind_of is bool or value is None:
            text = "true" if value is True else "false" if value is False else "null"
        elif kind_of is str and _plain(value):
            text = f'"{value}"'
        else:
            return None
        if not _plain(key):
            return None
        parts.append(f',"{key}":{text}')
    parts.append("}")
    return "".join(parts)


def _plain(text: str) -> bool:
    """A string JSON holds as it is: printable ASCII without quote or backslash."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text
