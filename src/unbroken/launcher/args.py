"""unbroken-run's command line: torchrun's flags (both spellings, ``PET_*`` defaults) plus ``--ft-*``.

torchrun's flags become a ``JobSpec`` (what to run, where, how many times); ``--ft-*`` flags and
the ``--ft-config`` YAML file become a ``LauncherConfig``. The ``PET_<DEST>`` environment
defaults mirror ``torch.distributed.argparse_util`` (the Kubernetes operators set them); they
are reimplemented here so that parsing does not import torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from unbroken import env as uenv
from unbroken.launcher import config as lconfig

EntryKind = Literal["script", "module", "command"]
ENTRY_KINDS: tuple[EntryKind, ...] = get_args(EntryKind)
# Flags torchrun has that unbroken-run accepts for compatibility and ignores (with a warning).
IGNORED = (
    "event_log_handler",
    "logs_specs",
    "numa_binding",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "virtual_local_rank",
    "local_ranks_filter",
)
_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^(\d+:[0-3],)*\d+:[0-3]$")


class _Env(argparse.Action):
    """A value flag whose default comes from ``PET_<DEST>`` (as torchrun's ``env`` action)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        default: Any = None,
        required: bool = False,
        **kwargs: Any,
    ) -> None:
        pet = uenv.pet_default(dest)
        default = default if pet is None else pet
        super().__init__(
            option_strings, dest, default=default, required=required and not default, **kwargs
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """A switch that is also on when ``PET_<DEST>`` is a non-zero integer (torchrun's check_env)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, default: bool = False, **kwargs: Any
    ) -> None:
        pet = uenv.pet_default(dest)
        try:
            default = bool(int(("1" if default else "0") if pet is None else pet))
        except ValueError:
            raise ValueError(
                f"{uenv.PET_PREFIX}{dest.upper()}={pet!r}: set it to 0 or 1 (or unset it)"
            ) from None
        super().__init__(option_strings, dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const)


@dataclass(frozen=True, kw_only=True)
class Entrypoint:
    """What each worker runs."""

    kind: EntryKind
    """"script" (a Python file), "module" (``-m``) or "command" (``--no-python``)."""
    target: str
    """The script path, module name or executable."""
    args: tuple[str, ...] = ()
    """Arguments after the target."""

    def __post_init__(self) -> None:
        if self.kind not in ENTRY_KINDS:
            raise ValueError(f"entrypoint kind must be one of {ENTRY_KINDS}, got {self.kind!r}")

    def cold_argv(self) -> list[str]:
        """The command line of a cold start, as torchrun builds it."""
        if self.kind == "command":
            return [self.target, *self.args]
        python = uenv.lookup(uenv.PYTHON_EXEC) or sys.executable
        head = ["-m", self.target] if self.kind == "module" else [self.target]
        return [python, "-u", *head, *self.args]


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """torchrun's options, resolved: the job's shape, its rendezvous, its restart budget."""

    min_nodes: int
    """Fewest nodes (agents) the job runs with."""
    max_nodes: int
    """Most nodes the job admits."""
    nproc_per_node: int
    """Workers this agent starts."""
    rdzv_endpoint: str
    """host:port of the c10d rendezvous store (port 0: pick one; standalone only)."""
    rdzv_id: str
    """The rendezvous id shared by every agent of the job."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Extra rendezvous parameters (``--rdzv-conf k=v,...``), passed to torch's handler."""
    is_host: bool | None = None
    """Whether this agent hosts the rendezvous store (None: torch decides by hostname)."""
    standalone: bool = False
    """Single node on localhost with an auto-assigned rendezvous."""
    max_restarts: int = 0
    """Restarts after worker failures before the job gives up."""
    monitor_interval_s: float = 0.1
    """Longest the agent sleeps between two looks at its workers."""
    role: str = "default"
    """The worker role name (ROLE_NAME)."""
    log_dir: Path | None = None
    """Where per-worker stdout/stderr files go when redirected or teed."""
    redirects: str = "0"
    """torchrun's -r: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank "0:3,1:0"."""
    tee: str = "0"
    """torchrun's -t: like redirects, and also copied to the console."""
    local_addr: str | None = None
    """This node's address as peers reach it."""
    node_rank: int = 0
    """torchrun's --node-rank (static backend: rank 0 hosts the store)."""
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    """Signals on which the agent stops its workers and exits (torchrun's --signals-to-handle)."""
    shutdown_timeout_s: float | None = None
    """torchrun's --shutdown-timeout, if given (used as stop grace unless --ft-stop-grace-s)."""
    entry: Entrypoint
    """What each worker runs."""

    def __post_init__(self) -> None:
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got "
                f"{self.min_nodes}:{self.max_nodes}"
            )
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not (math.isfinite(self.monitor_interval_s) and self.monitor_interval_s > 0):
            raise ValueError(
                f"--monitor-interval must be a finite number > 0, got {self.monitor_interval_s}"
            )
        if self.shutdown_timeout_s is not None and not (
            math.isfinite(self.shutdown_timeout_s) and self.shutdown_timeout_s >= 0
        ):
            raise ValueError(
                f"--shutdown-timeout must be a finite number >= 0, got {self.shutdown_timeout_s}"
            )
        if self.node_rank < 0:
            raise ValueError(f"--node-rank must be >= 0, got {self.node_rank}")
        host, sep, port = self.rdzv_endpoint.rpartition(":")
        if sep and not (port.isdigit() and 0 <= int(port) <= 65535 and host):
            raise ValueError(
                f"--rdzv-endpoint must be host or host:port (port 0-65535), got "
                f"{self.rdzv_endpoint!r}"
            )
        for name in self.stop_signals:
            if not (name.startswith("SIG") and hasattr(signal, name)):
                raise ValueError(f"--signals-to-handle: unknown signal {name!r}")
        for name in ("redirects", "tee"):
            value = getattr(self, name)
            if not (_STD_VALUE.match(value) or _STD_MAPPING.match(value)):
                raise ValueError(f"--{name} must be 0-3 or a mapping like 0:3,1:0; got {value!r}")

    def std_for(self, name: str, local_rank: int) -> int:
        """The redirect or tee bits (1 stdout, 2 stderr) for a local rank."""
        value = getattr(self, name)
        if _STD_VALUE.match(value):
            return int(value)
        mapping = dict(item.split(":") for item in value.split(","))
        return int(mapping.get(str(local_rank), "0"))


def _both(name: str) -> list[str]:
    dashed = "--" + name.replace("_", "-")
    under = "--" + name
    return [dashed] if dashed == under else [dashed, under]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unbroken-run",
        description="A torchrun-compatible launcher that restarts killed and hung workers "
        "inside the job. torchrun's flags work as in torchrun; unbroken's own options are "
        "--ft-* flags or keys of the --ft-config YAML file.",
    )
    val = p.add_argument
    val(*_both("nnodes"), action=_Env, default="1:1", help="N or MIN:MAX nodes")
    val(*_both("nproc_per_node"), action=_Env, default="1", help="workers per node: N|cpu|gpu|auto")
    val(*_both("rdzv_backend"), action=_Env, default="static", help="c10d (static is mapped)")
    val(*_both("rdzv_endpoint"), action=_Env, default="", help="host:port of the c10d store")
    val(*_both("rdzv_id"), action=_Env, default="none", help="job id shared by every node")
    val(*_both("rdzv_conf"), action=_Env, default="", help="k=v,... rendezvous parameters")
    val("--standalone", action=_CheckEnv, help="single node, rendezvous on localhost")
    val(*_both("max_restarts"), action=_Env, type=int, default=0, help="restart budget")
    val(
        *_both("monitor_interval"),
        action=_Env,
        type=float,
        default=0.1,
        help="seconds between looks at the workers",
    )
    val(
        *_both("start_method"),
        action=_Env,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="accepted; see --ft-warm-pool",
    )
    val("--role", action=_Env, default="default", help="worker role name")
    val("-m", "--module", action=_CheckEnv, help="run the target as a module (python -m)")
    val(*_both("no_python"), action=_CheckEnv, help="run the target as an executable")
    val(*_both("run_path"), action=_CheckEnv, help="run the target script with runpy")
    val(*_both("log_dir"), action=_Env, default=None, help="per-worker log directory")
    val("-r", "--redirects", action=_Env, default="0", help="0-3 or 0:3,1:0 (1 out, 2 err)")
    val("-t", "--tee", action=_Env, default="0", help="like --redirects, also to the console")
    val(*_both("node_rank"), action=_Env, type=int, default=0, help="static backend node rank")
    val(*_both("master_addr"), action=_Env, default="127.0.0.1", help="static backend host")
    val(*_both("master_port"), action=_Env, type=int, default=None, help="static backend port")
    val(*_both("local_addr"), action=_Env, default=None, help="this node's address")
    val(
        *_both("signals_to_handle"),
        action=_Env,
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals the agent forwards to workers before exiting",
    )
    val(
        *_both("shutdown_timeout"),
        action=_Env,
        type=float,
        default=None,
        help="grace seconds between SIGTERM and SIGKILL (see --ft-stop-grace-s)",
    )
    for name in IGNORED:
        if name == "virtual_local_rank":
            val(*_both(name), action=_CheckEnv, help=argparse.SUPPRESS)
        else:
            val(*_both(name), action=_Env, default=None, help=argparse.SUPPRESS)
    ft = p.add_argument_group("unbroken options (also keys of the --ft-config YAML file)")
    ft.add_argument(
        *_both("ft_config"),
        dest="ft_config",
        default=None,
        metavar="YAML",
        help="a YAML file of the options below; flags override it",
    )
    docs = lconfig.field_docs()
    for name in lconfig.FIELDS:
        flags = _both("ft_" + name)
        if lconfig.kind_of(name) == "bool":
            ft.add_argument(
                flags[0],
                dest="ft_" + name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=docs.get(name, ""),
            )
        else:
            ft.add_argument(*flags, dest="ft_" + name, default=None, help=docs.get(name, ""))
    p.add_argument("training_script", help="the script, module or executable each worker runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}")


# --rdzv-conf keys whose values are seconds (> 0), counts (>= 1) or booleans
_RDZV_SECONDS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "read_timeout",
)
_RDZV_COUNTS = ("keep_alive_max_attempt",)
_RDZV_BOOLS = ("is_host",)
_BOOL_WORDS = ("1", "0", "true", "false", "yes", "no")


def _check_rdzv_value(key: str, v: str) -> None:
    if key in _RDZV_SECONDS:
        try:
            ok = math.isfinite(float(v)) and float(v) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--rdzv-conf {key}={v!r} must be a number of seconds > 0")
    elif key in _RDZV_COUNTS:
        if not (v.isdigit() and int(v) >= 1):
            raise ValueError(f"--rdzv-conf {key}={v!r} must be an integer >= 1")
    elif key in _RDZV_BOOLS and v.lower() not in _BOOL_WORDS:
        raise ValueError(f"--rdzv-conf {key}={v!r} must be one of {', '.join(_BOOL_WORDS)}")


def parse_rdzv_conf(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, v = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf entries must be key=value, got {item!r}")
        _check_rdzv_value(key.strip(), v.strip())
        out[key.strip()] = v.strip()
    return out


def resolve_nproc(value: str) -> int:
    """N, or cpu/gpu/auto as torchrun resolves them."""
    try:
        return int(value)
    except ValueError:
        pass
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if value == "auto":
            return os.cpu_count() or 1
        raise ValueError("--nproc-per-node gpu: CUDA is not available")
    raise ValueError(f"--nproc-per-node must be an integer, cpu, gpu or auto; got {value!r}")


def _rendezvous(
    ns: argparse.Namespace, max_nodes: int, conf: dict[str, str]
) -> tuple[str, str, bool | None]:
    """(endpoint, rdzv id, is_host) as torchrun resolves --standalone and static."""
    backend = ns.rdzv_backend
    single_static = (
        backend == "static" and not ns.rdzv_endpoint and ns.master_port is None and max_nodes == 1
    )
    if ns.standalone or single_static:
        return "127.0.0.1:0", str(uuid.uuid4()), True
    if backend == "static":
        endpoint = ns.rdzv_endpoint or f"{ns.master_addr}:{ns.master_port or 29500}"
        return endpoint, ns.rdzv_id, ns.node_rank == 0
    if backend != "c10d":
        raise ValueError(
            f"--rdzv-backend {backend!r} is not supported by unbroken-run; use c10d (static is "
            "served by c10d too)"
        )
    if not ns.rdzv_endpoint:
        raise ValueError("--rdzv-backend c10d needs --rdzv-endpoint host:port")
    is_host = conf.get("is_host")
    host_flag = None if is_host is None else is_host.lower() in ("1", "true", "yes")
    return ns.rdzv_endpoint, ns.rdzv_id, host_flag


def spec_from_namespace(ns: argparse.Namespace) -> JobSpec:
    if ns.module and ns.no_python:
        raise ValueError("don't use both --no-python and -m/--module")
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    conf = parse_rdzv_conf(ns.rdzv_conf)
    endpoint, rdzv_id, is_host = _rendezvous(ns, max_nodes, conf)
    kind: EntryKind = "command" if ns.no_python else "module" if ns.module else "script"
    return JobSpec(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=resolve_nproc(str(ns.nproc_per_node)),
        rdzv_endpoint=endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=conf,
        is_host=is_host,
        standalone=endpoint == "127.0.0.1:0",
        max_restarts=int(ns.max_restarts),
        monitor_interval_s=float(ns.monitor_interval),
        role=ns.role,
        log_dir=Path(ns.log_dir) if ns.log_dir else None,
        redirects=str(ns.redirects),
        tee=str(ns.tee),
        local_addr=ns.local_addr,
        node_rank=int(ns.node_rank),
        stop_signals=tuple(s.strip() for s in ns.signals_to_handle.split(",") if s.strip()),
        shutdown_timeout_s=ns.shutdown_timeout,
        entry=Entrypoint(kind=kind, target=ns.training_script, args=tuple(ns.training_script_args)),
    )


def config_from_namespace(ns: argparse.Namespace) -> lconfig.LauncherConfig:
    overrides: dict[str, Any] = {}
    for name in lconfig.FIELDS:
        raw = getattr(ns, "ft_" + name)
        if raw is not None:
            flag = "--ft-" + name.replace("_", "-")
            overrides[name] = lconfig.coerce(name, raw, source=flag)
    if ns.shutdown_timeout is not None and "stop_grace_s" not in overrides:
        overrides["stop_grace_s"] = lconfig.coerce(
            "stop_grace_s", ns.shutdown_timeout, source="--shutdown-timeout"
        )
    return lconfig.build(yaml_path=ns.ft_config, **overrides)


def parse(argv: Sequence[str] | None = None) -> tuple[JobSpec, lconfig.LauncherConfig, list[str]]:
    """(job spec, launcher config, names of ignored torchrun flags that were given)."""
    ns = build_parser().parse_args(argv)
    ignored = [n for n in IGNORED if getattr(ns, n) not in (None, False)]
    return spec_from_namespace(ns), config_from_namespace(ns), ignored
