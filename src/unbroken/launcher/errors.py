"""Failures, their causes and categories, the launcher's exit codes and its error file.

Exit codes of ``unbroken-run``:

==========  ======================================================================
0           every worker exited 0
1           the launcher itself crashed (a bug: please report it)
2           bad flags or configuration (also: a worker exited with ``EXIT_CONFIG``, 78)
3           restart budget exhausted (``--max-restarts`` failures already restarted)
4           no progress: ``max_no_progress_restarts`` restarts in a row without a new step
5           rendezvous failed (timeout, closed by another agent, store unreachable)
6           checkpoint storage failed for good: a worker exited with ``EXIT_STORAGE``, 74
            (``on_storage_failure="stop"``)
7           this node failed a node check (``--ft-node-checks``) and did not join the job
128 + N     the agent received signal N (SIGTERM, SIGINT, ...) and stopped its workers
==========  ======================================================================

The error file (``--ft-error-file``, default ``<run_dir>/error.json``) names the root cause: the
first failure by time in the round that made the job give up, with rank, cause and category:

- ``user``: the training code failed (a Python exception, a non-zero exit code);
- ``platform``: the process was killed by its machine (OOM kill, segfault, abort, bus error);
- ``infra``: the job's surroundings failed (SIGKILL/SIGTERM from outside, a hang, a rendezvous).
"""

from __future__ import annotations

import json
import signal as _signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unbroken.errors import UnbrokenError
from unbroken.ledger.durable import write_atomic

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_BUDGET_EXHAUSTED = 3
EXIT_NO_PROGRESS = 4
EXIT_RENDEZVOUS_FAILED = 5
EXIT_STORAGE_FAILED = 6
EXIT_NODE_UNHEALTHY = 7

REASONS = {
    EXIT_USAGE: "config_error",
    EXIT_BUDGET_EXHAUSTED: "restart_budget_exhausted",
    EXIT_NO_PROGRESS: "no_progress",
    EXIT_RENDEZVOUS_FAILED: "rendezvous_failed",
}

CATEGORIES = ("user", "platform", "infra")

# Signal -> (cause, category). An OOM kill is a SIGKILL with evidence (see oom_kill_count).
_SIGNAL_CAUSES: dict[int, tuple[str, str]] = {
    _signal.SIGKILL: ("sigkill", "infra"),
    _signal.SIGTERM: ("sigterm", "infra"),
    _signal.SIGINT: ("sigint", "infra"),
    _signal.SIGHUP: ("sighup", "infra"),
    _signal.SIGSEGV: ("segfault", "platform"),
    _signal.SIGABRT: ("sigabrt", "platform"),
    _signal.SIGBUS: ("sigbus", "platform"),
    _signal.SIGILL: ("sigill", "platform"),
    _signal.SIGFPE: ("sigfpe", "platform"),
}


class LauncherError(UnbrokenError):
    """The launcher could not do its job (spawn workers, reach the rendezvous)."""


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failure the agent saw: a worker exit, a hang, a rendezvous error, a signal."""

    rank: int
    """Global rank of the failed worker; -1 for the agent (rendezvous, signal)."""
    local_rank: int
    """Rank on this node; -1 for the agent."""
    cause: str
    """sigkill, oom-kill, segfault, sigabrt, exception, exit_code, hang, rendezvous, ..."""
    category: str
    """user, platform or infra (see the module docstring)."""
    detector: str
    """What saw it: exit, heartbeat, rendezvous, signal, spawn."""
    ts: float
    """Epoch seconds when the agent saw it."""
    round: int = -1
    """The restart round it happened in."""
    exit_code: int | None = None
    """The worker's exit code, when it exited normally."""
    signal: str | None = None
    """The signal that ended the worker (e.g. SIGKILL), when one did."""
    pid: int | None = None
    """The worker's pid."""
    message: str = ""
    """Human-readable detail (the exception of the worker's error file, the last step, ...)."""

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {self.category!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def read_worker_error(path: Path) -> str | None:
    """The message of an elastic error file (``@record``), or None if absent/unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        text = str(msg.get("message", ""))
        stack = str((msg.get("extraInfo") or {}).get("py_callstack", ""))
        return f"{text}\n{stack}".strip() if stack else text
    return None if msg is None else str(msg)


def classify_exit(
    *,
    exit_code: int | None,
    signum: int | None,
    error_message: str | None,
    oom_killed: bool,
) -> tuple[str, str, str]:
    """(cause, category, message) of a failed worker exit, as precisely as the evidence allows."""
    if signum is not None:
        if signum == _signal.SIGKILL and oom_killed:
            return "oom-kill", "platform", "SIGKILL with an OOM kill recorded in the cgroup"
        cause, category = _SIGNAL_CAUSES.get(signum, (f"signal:{signal_name(signum)}", "infra"))
        return cause, category, f"terminated by {signal_name(signum)}"
    if error_message:
        return "exception", "user", error_message[:4000]
    if exit_code is not None and exit_code > 128 and (exit_code - 128) in _SIGNAL_CAUSES:
        # A shell wrapper reports its child's signal as 128 + N.
        cause, category = _SIGNAL_CAUSES[exit_code - 128]
        return cause, category, f"exit code {exit_code} (128 + {signal_name(exit_code - 128)})"
    return "exit_code", "user", f"exit code {exit_code}"


def _oom_counter_files() -> list[Path]:
    """Candidate files holding this cgroup's ``oom_kill`` counter (v2 first, then v1)."""
    v2: list[Path] = []
    v1: list[Path] = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":
                v2.append(Path("/sys/fs/cgroup") / rel / "memory.events")
            elif "memory" in controllers.split(","):
                v1.append(Path("/sys/fs/cgroup/memory") / rel / "memory.oom_control")
    except (OSError, ValueError):
        pass
    # In a container the cgroup namespace root is mounted at the top.
    return [
        *v2,
        Path("/sys/fs/cgroup/memory.events"),
        *v1,
        Path("/sys/fs/cgroup/memory/memory.oom_control"),
    ]


def oom_kill_count() -> int | None:
    """This cgroup's ``oom_kill`` counter (cgroup v2 or v1), or None when unreadable."""
    for path in _oom_counter_files():
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                try:
                    return int(value)
                except ValueError:
                    return None
    return None


def root_cause(failures: list[Failure]) -> Failure | None:
    """The first failure by time (ties: the lower rank)."""
    return min(failures, key=lambda f: (f.ts, f.rank), default=None)


def write_error_file(
    path: Path,
    *,
    exit_code: int,
    failures: list[Failure],
    restarts: int,
    run_id: str,
) -> dict[str, Any]:
    """Write the launcher's error file atomically and durably (``unbroken.ledger.durable``):
    after a crash it holds this record or the previous one, never a torn one. Returns what was
    written."""
    root = root_cause(failures)
    out: dict[str, Any] = {
        "rank": None if root is None else root.rank,
        "cause": None if root is None else root.cause,
        "category": None if root is None else root.category,
        "exit_code": None if root is None else root.exit_code,
        "signal": None if root is None else root.signal,
        "ts": time.time() if root is None else root.ts,
        "message": "" if root is None else root.message,
        "local_rank": None if root is None else root.local_rank,
        "detector": None if root is None else root.detector,
        "round": None if root is None else root.round,
        "reason": REASONS.get(exit_code, "terminated" if exit_code >= 128 else "failed"),
        "launcher_exit_code": exit_code,
        "restarts": restarts,
        "run": run_id,
        "failures": [f.to_dict() for f in sorted(failures, key=lambda f: (f.ts, f.rank))],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=1, default=str))
    return out
