"""``LauncherConfig``: unbroken-run's own options, from ``--ft-*`` flags and one YAML file.

Every field maps one-to-one to a flag ``--ft-<field-with-dashes>`` (``--ft-<field>`` with
underscores is accepted too) and to a YAML key of the same name. Precedence: defaults < YAML
file (``--ft-config``) < flags. torchrun's own flags (``--nnodes``, ``--max-restarts``, ...) are
not here: they live in ``args.JobSpec``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

# What the warm pool imports before it forks a worker: torch, its distributed package, the
# lazily imported torch._dynamo that the first DDP()/fully_shard() otherwise pays (about a
# second on CPU), DCP (state dicts and checkpoints of FSDP2 jobs) and elastic's @record, FSDP;
# and unbroken's own worker-side packages (side-effect-free imports, otherwise a good part of a
# restarted worker's start-up).
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.elastic.multiprocessing.errors",
    "unbroken.job",
    "unbroken.checkpoint",
    "unbroken.restart",
    "unbroken.faults",
)

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_HOST = re.compile(r"^[A-Za-z0-9_.:\[\]-]{1,253}$")
_OCTAL = re.compile(r"^0?[0-7]{1,3}$")


NODE_CHECKS = ("checkpoint", "shm", "memory", "memfd", "cuda", "clock", "cgroup")
"""The checks of ``unbroken doctor`` a node can run before it joins (``node_checks``): the ones
that look at this machine alone (not gloo, ports or network namespaces)."""


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """unbroken-run's options; ``__post_init__`` checks values and timeout ordering."""

    run_dir: Path | None = None
    """Run directory: the agent's ledger, error file and state; workers get UNBROKEN_RUN_DIR."""
    error_file: Path | None = None
    """Where the root cause is written when the job gives up (default: <run_dir>/error.json)."""
    warm_pool: bool = True
    """Fork workers from a process that has already imported ``preload`` (else cold starts)."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules the warm pool imports before forking workers (comma-separated on the CLI)."""
    node_checks: tuple[str, ...] = ()
    """Checks of ``unbroken doctor`` this node must pass before it joins a rendezvous
    (comma-separated: checkpoint, shm, memory, memfd, cuda, clock, cgroup); a node failing one
    is kept out of the job and exits 7."""
    node_check_dir: Path | None = None
    """The checkpoint directory the "checkpoint" node check writes, locks and renames in."""
    hang_detection: bool = True
    """Kill and restart workers whose heartbeats stop (see the initial and steady timeouts)."""
    heartbeat_interval_s: float = 0.5
    """Least seconds between two heartbeat datagrams of a worker whose step did not change."""
    initial_timeout_s: float = 300.0
    """Seconds a worker may take from its start to its first heartbeat."""
    steady_timeout_s: float = 120.0
    """Seconds a worker may go between two heartbeats once it has sent one."""
    auto_timeouts: bool = True
    """Shrink both timeouts to what the job shows it needs (calibrate.py; off when a timeout is
    given explicitly, unless this is given too)."""
    auto_timeout_factor: float = 16.0
    """Safety factor applied to observed heartbeat gaps when ``auto_timeouts`` is on."""
    rdzv_timeout_s: float = 600.0
    """Seconds a rendezvous round may take (the c10d join timeout, unless --rdzv-conf sets it)."""
    stop_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    max_no_progress_restarts: int = 3
    """Give up after this many restarts in a row without a new step (0: never)."""
    metrics_port: int | None = None
    """Serve the run's Prometheus /metrics on this port (0: any free port)."""
    metrics_host: str | None = None
    """Address /metrics listens on (default: 127.0.0.1 for a job on this machine alone, else all)."""
    resume: bool = False
    """Continue the run a previous launch left in the run directory (its run id, ledger,
    checkpoints) instead of refusing the directory; a relaunched node of the same job needs it."""
    umask: str = "077"
    """Octal umask of the agent and its workers: 077 makes run and checkpoint files private."""
    rdzv_poll_s: float = 1.0
    """Seconds between two looks at the rendezvous state while nodes gather (torch polls 1 s)."""
    membership_check_s: float = 1.0
    """Seconds between two checks, while training, for a lost node or a node waiting to join."""
    handover: bool = True
    """After another node is lost, keep this node's workers: they leave the training function
    and take their ranks in the next round in-process (``unbroken.restart.handover``) instead of
    being replaced by new processes, which start cold. Scripts without in-process restart are
    stopped and restarted as before."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        for name in ("heartbeat_interval_s", "initial_timeout_s", "steady_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("initial_timeout_s", "steady_timeout_s"):
            if not self.heartbeat_interval_s < getattr(self, name):
                raise ValueError(
                    f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be smaller than "
                    f"{name} ({getattr(self, name)}): a healthy worker would look hung"
                )
            if not getattr(self, name) < self.rdzv_timeout_s:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be smaller than rdzv_timeout_s "
                    f"({self.rdzv_timeout_s}): a hang must be caught before a rendezvous "
                    "gives up on the node"
                )
        if not self.auto_timeout_factor > 1:
            raise ValueError(f"auto_timeout_factor must be > 1, got {self.auto_timeout_factor}")
        if self.stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        if self.max_no_progress_restarts < 0:
            raise ValueError(
                f"max_no_progress_restarts must be >= 0 (0: off), got "
                f"{self.max_no_progress_restarts}"
            )
        if self.metrics_host is not None and not _HOST.match(self.metrics_host):
            raise ValueError(
                f"metrics_host must be an address or host name like 0.0.0.0, got "
                f"{self.metrics_host!r}"
            )
        if not (_OCTAL.match(self.umask) and int(self.umask, 8) <= 0o777):
            raise ValueError(f"umask must be octal digits like 077 or 022, got {self.umask!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port 0-65535, got {self.metrics_port}")
        for name in ("rdzv_poll_s", "membership_check_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in self.node_checks:
            if name not in NODE_CHECKS:
                raise ValueError(
                    f"node_checks: {name!r} is not a node check; choose from "
                    f"{', '.join(NODE_CHECKS)}"
                )
        if "checkpoint" in self.node_checks and self.node_check_dir is None:
            raise ValueError(
                "node_checks has 'checkpoint' but node_check_dir is not set: name the "
                "checkpoint directory to check (--ft-node-check-dir)"
            )
        for mod in self.preload:
            if not _MODULE_NAME.match(mod):
                raise ValueError(f"preload entry {mod!r} is not a module name like 'torch.nn'")

    def error_path(self, run_dir: Path) -> Path:
        return self.error_file if self.error_file is not None else run_dir / "error.json"


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in fields(LauncherConfig)}


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's one-line docstring (used as the flag's help text)."""
    tree = ast.parse(inspect.getsource(LauncherConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


def kind_of(name: str) -> str:
    """The value kind of a field: bool, int, float, path, text, modules, port (an int or None)."""
    if name in ("run_dir", "error_file", "node_check_dir"):
        return "path"
    if name in ("metrics_host", "umask"):
        return "text"
    if name in ("preload", "node_checks"):
        return "modules"
    if name == "metrics_port":
        return "port"
    default = FIELDS[name].default
    if isinstance(default, bool):
        return "bool"
    return "int" if isinstance(default, int) else "float"


def coerce(name: str, value: Any, *, source: str) -> Any:
    """Convert a YAML or CLI value for field ``name``; ValueError names the source."""
    kind = kind_of(name)
    if value is None:
        if kind in ("path", "port") or name == "metrics_host":
            return None
        raise ValueError(f"{source}: {name} needs a value, got null")
    if kind == "path":
        if not isinstance(value, str) or not value or "\0" in value:
            raise ValueError(f"{source}: {name} must be a path, got {value!r:.80}")
        return Path(value)
    if kind == "text":
        if not isinstance(value, str):
            hint = (
                ' (quote it: umask: "077"; YAML reads 077 as a number)' if name == "umask" else ""
            )
            raise ValueError(f"{source}: {name} must be a string, got {value!r:.80}{hint}")
        return value
    if kind == "modules":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(m, str) for m in items):
            what = "module names" if name == "preload" else "check names"
            raise ValueError(f"{source}: {name} must be a list of {what}, got {value!r:.80}")
        return tuple(m.strip() for m in items if m.strip())
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"{source}: {name} must be true or false, got {value!r}")
    what = "a finite number" if kind == "float" else "an integer"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{source}: {name} must be {what}, got {value!r:.80}")
    try:
        if kind == "float":
            out: float = float(value)
        elif isinstance(value, float):
            out = int(value) if value.is_integer() else math.nan  # 1.5 is no integer
        else:
            out = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{source}: {name} must be {what}, got {value!r:.80}") from None
    if isinstance(out, float) and not math.isfinite(out):
        raise ValueError(f"{source}: {name} must be {what}, got {value!r:.80}")
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Field values from a YAML file (a mapping of field names); ValueError on bad content."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"launcher config {p} does not exist")
    try:
        obj = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{p}: not valid YAML (UTF-8): {e}; fix the file") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot read the launcher config: {e}") from None
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise ValueError(f"{p}: expected a mapping of launcher options, got {obj!r:.80}")
    unknown = sorted(str(k) for k in set(obj) - set(FIELDS))
    if unknown:
        raise ValueError(f"{p}: unknown keys {unknown}; valid keys: {sorted(FIELDS)}")
    return {k: coerce(k, v, source=str(p)) for k, v in obj.items()}


def build(*, yaml_path: str | Path | None = None, **overrides: Any) -> LauncherConfig:
    """Defaults, then the YAML file, then ``overrides`` (flags given; None means not given)."""
    values = load_yaml(yaml_path) if yaml_path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "auto_timeouts" not in values and (
        "initial_timeout_s" in values or "steady_timeout_s" in values
    ):
        values["auto_timeouts"] = False  # an explicit timeout wins
    return LauncherConfig(**values)
