"""Every environment variable unbroken reads, named once, and the one place that reads them.

The torchrun names are the contract with unmodified torchrun scripts and with Kubernetes
operators; the ``UNBROKEN_*`` names are ours. Code elsewhere reads the process environment only
through this module (``WorkerEnv``, ``HeartbeatEnv``, ``lookup``); building a child process's
environment (``dict(os.environ, ...)``) is not reading it. Imports of ours: none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# torchrun's worker environment
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

# ours
UNBROKEN_RUN_DIR = "UNBROKEN_RUN_DIR"
UNBROKEN_RUN_ID = "UNBROKEN_RUN_ID"
UNBROKEN_FAULTS = "UNBROKEN_FAULTS"
"""A fault plan (YAML) that ``unbroken.run`` fires from ``ctx.step_done``; set by the user (it
passes through the launcher), for testing a script's recovery without changing it."""


# ours: a benchmark's (or an operator's) configuration of an adopted script, from outside it.
# ``Overrides`` reads them; they win over what the script passes (see its docstring).
UNBROKEN_CKPT_MODE = "UNBROKEN_CKPT_MODE"
UNBROKEN_CKPT_EVERY = "UNBROKEN_CKPT_EVERY"
UNBROKEN_SNAPSHOT_EVERY = "UNBROKEN_SNAPSHOT_EVERY"
UNBROKEN_MEMORY_TIER = "UNBROKEN_MEMORY_TIER"
UNBROKEN_INPROCESS = "UNBROKEN_INPROCESS"
UNBROKEN_SOFT_TIMEOUT_S = "UNBROKEN_SOFT_TIMEOUT_S"
UNBROKEN_HARD_TIMEOUT_S = "UNBROKEN_HARD_TIMEOUT_S"
UNBROKEN_PHASE_TIMEOUTS = "UNBROKEN_PHASE_TIMEOUTS"
UNBROKEN_PG_TIMEOUT_S = "UNBROKEN_PG_TIMEOUT_S"
UNBROKEN_MAX_RANK_FAULTS = "UNBROKEN_MAX_RANK_FAULTS"
UNBROKEN_FINAL_DIGEST = "UNBROKEN_FINAL_DIGEST"
OVERRIDE_NAMES = (
    UNBROKEN_CKPT_MODE,
    UNBROKEN_CKPT_EVERY,
    UNBROKEN_SNAPSHOT_EVERY,
    UNBROKEN_MEMORY_TIER,
    UNBROKEN_INPROCESS,
    UNBROKEN_SOFT_TIMEOUT_S,
    UNBROKEN_HARD_TIMEOUT_S,
    UNBROKEN_PHASE_TIMEOUTS,
    UNBROKEN_PG_TIMEOUT_S,
    UNBROKEN_MAX_RANK_FAULTS,
    UNBROKEN_FINAL_DIGEST,
)


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What a worker learns about its place in the job from its environment."""

    rank: int
    """Global rank (0 when not launched by a launcher)."""
    local_rank: int
    """Rank on this node."""
    world_size: int
    """Number of ranks in the job."""
    local_world_size: int
    """Number of ranks on this node."""
    group_rank: int
    """This node's rank among the nodes."""
    master_addr: str | None
    """Host of the store the launcher set up, or None for a standalone process."""
    master_port: int | None
    """Port of that store."""
    restart_count: int
    """How many times the launcher restarted the workers (the attempt number)."""
    run_id: str | None
    """The job's run id given by the launcher."""
    use_agent_store: bool
    """True when the launcher hosts the store at MASTER_ADDR:MASTER_PORT (connect as client)."""
    run_dir: Path | None
    """Run directory handed down by ``unbroken-run``."""
    agent_pid: int | None = None
    """Pid of the ``unbroken-run`` agent that started this worker (None outside it)."""
    store_addr: str | None = None
    """``host:port`` of the job-long coordination store ``unbroken-run`` hosts (None outside)."""
    memory_keeper: str | None = None
    """Address of the node agent's memory keeper (``UNBROKEN_MEMORY_KEEPER``; None outside)."""
    peers: tuple[str, ...] = ()
    """Every node's peer memory service, in group-rank order (``UNBROKEN_PEERS``; () outside
    a multi-node ``unbroken-run`` job)."""
    fault_plan: Path | None = None
    """The fault plan named by ``UNBROKEN_FAULTS``, if any."""
    handover: str | None = None
    """This worker's key prefix in the job store for the agent's handover to the next round
    (``UNBROKEN_HANDOVER``; None outside a multi-node ``unbroken-run`` job)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"{WORLD_SIZE} must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"{RANK}={self.rank} is outside [0, {WORLD_SIZE}={self.world_size}); "
                "check the launcher's environment"
            )

    @property
    def launched(self) -> bool:
        """True when a launcher (torchrun or unbroken-run) started this process."""
        return self.master_addr is not None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        e = os.environ if environ is None else environ
        world = _int(e, WORLD_SIZE, 1)
        port_raw = e.get(MASTER_PORT)
        run_dir = e.get(UNBROKEN_RUN_DIR)
        return cls(
            rank=_int(e, RANK, 0),
            local_rank=_int(e, LOCAL_RANK, 0),
            world_size=world,
            local_world_size=_int(e, LOCAL_WORLD_SIZE, world),
            group_rank=_int(e, GROUP_RANK, 0),
            master_addr=e.get(MASTER_ADDR) or None,
            master_port=_int(e, MASTER_PORT, 0) if port_raw else None,
            restart_count=_int(e, RESTART_COUNT, 0),
            run_id=e.get(UNBROKEN_RUN_ID) or e.get(RUN_ID) or None,
            use_agent_store=e.get(USE_AGENT_STORE) == "True",
            run_dir=Path(run_dir) if run_dir else None,
            agent_pid=_int(e, UNBROKEN_AGENT_PID, 0) or None,
            store_addr=e.get(UNBROKEN_STORE_ADDR) or None,
            memory_keeper=e.get(UNBROKEN_MEMORY_KEEPER) or None,
            peers=tuple(p for p in (e.get(UNBROKEN_PEERS) or "").split(",") if p),
            fault_plan=Path(e[UNBROKEN_FAULTS]) if e.get(UNBROKEN_FAULTS) else None,
            handover=e.get(UNBROKEN_HANDOVER) or None,
        )


def _bad(name: str, raw: str, what: str) -> ValueError:
    return ValueError(
        f"environment variable {name}={raw!r}: {what}; fix or unset it "
        "(see `unbroken bench recovery --help` for what each override does)"
    )


def _flag(e: Mapping[str, str], name: str) -> bool | None:
    raw = e.get(name, "")
    if raw == "":
        return None
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise _bad(name, raw, "must be 1 or 0")


def _count(e: Mapping[str, str], name: str, low: int) -> int | None:
    raw = e.get(name, "")
    if raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, f"must be an integer >= {low}") from None
    if value < low:
        raise _bad(name, raw, f"must be an integer >= {low}")
    return value


def _seconds(e: Mapping[str, str], name: str, raw: str | None = None) -> float | None:
    raw = e.get(name, "") if raw is None else raw
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise _bad(name, raw, "must be a number of seconds > 0")
    return value


def _phase_timeouts(e: Mapping[str, str]) -> tuple[tuple[str, float], ...]:
    raw = e.get(UNBROKEN_PHASE_TIMEOUTS, "")
    out: dict[str, float] = {}
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise _bad(UNBROKEN_PHASE_TIMEOUTS, raw, "must be name=seconds[,name=seconds...]")
        try:
            seconds = _seconds(e, UNBROKEN_PHASE_TIMEOUTS, value.strip() or "?")
        except ValueError:
            raise _bad(
                UNBROKEN_PHASE_TIMEOUTS, raw, f"{item}: must be a number of seconds > 0"
            ) from None
        assert seconds is not None
        out[name.strip()] = seconds
    return tuple(sorted(out.items()))


@dataclass(frozen=True, kw_only=True)
class Overrides:
    """A configuration given to an adopted script from outside it, through the environment
    (``UNBROKEN_CKPT_MODE`` ...): how a benchmark runs a user's own job under each
    configuration without editing it. Each field, when set, wins over what the script passes
    (``Checkpointer`` arguments, ``unbroken.run``'s ``RestartConfig``); None: not overridden."""

    ckpt_mode: str | None = None
    """``UNBROKEN_CKPT_MODE``: "async" or "sync" (``CheckpointConfig.mode``)."""
    ckpt_every: int | None = None
    """``UNBROKEN_CKPT_EVERY``: the durable interval in steps (``every_steps``; 0: none)."""
    snapshot_every: int | None = None
    """``UNBROKEN_SNAPSHOT_EVERY``: steps between memory snapshots (``snapshot_every``)."""
    memory_tier: bool | None = None
    """``UNBROKEN_MEMORY_TIER``: 0 keeps no snapshot in memory (every restore reads disk)."""
    inprocess: bool | None = None
    """``UNBROKEN_INPROCESS``: 0 turns in-process restart off (``RestartConfig.enabled``)."""
    soft_timeout_s: float | None = None
    """``UNBROKEN_SOFT_TIMEOUT_S``: the steady hang timeout (``RestartConfig.soft_timeout_s``)."""
    hard_timeout_s: float | None = None
    """``UNBROKEN_HARD_TIMEOUT_S``: the steady kill timeout (``RestartConfig.hard_timeout_s``)."""
    phase_timeouts_s: tuple[tuple[str, float], ...] = ()
    """``UNBROKEN_PHASE_TIMEOUTS``: ``name=seconds,...``, hang timeouts of phases."""
    pg_timeout_s: float | None = None
    """``UNBROKEN_PG_TIMEOUT_S``: the collective timeout (``RestartConfig.pg_timeout_s``)."""
    max_rank_faults: int | None = None
    """``UNBROKEN_MAX_RANK_FAULTS``: faults of one rank before in-process restart hands over."""
    final_digest: bool | None = None
    """``UNBROKEN_FINAL_DIGEST``: 1 records a digest of each rank's final state in the ledger
    (``CheckpointConfig.final_digest``)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Overrides:
        """The overrides set in the environment; ValueError naming a malformed one."""
        e = os.environ if environ is None else environ
        mode = e.get(UNBROKEN_CKPT_MODE, "") or None
        if mode is not None and mode not in ("async", "sync"):
            raise _bad(UNBROKEN_CKPT_MODE, mode, 'must be "async" or "sync"')
        return cls(
            ckpt_mode=mode,
            ckpt_every=_count(e, UNBROKEN_CKPT_EVERY, 0),
            snapshot_every=_count(e, UNBROKEN_SNAPSHOT_EVERY, 0),
            memory_tier=_flag(e, UNBROKEN_MEMORY_TIER),
            inprocess=_flag(e, UNBROKEN_INPROCESS),
            soft_timeout_s=_seconds(e, UNBROKEN_SOFT_TIMEOUT_S),
            hard_timeout_s=_seconds(e, UNBROKEN_HARD_TIMEOUT_S),
            phase_timeouts_s=_phase_timeouts(e),
            pg_timeout_s=_seconds(e, UNBROKEN_PG_TIMEOUT_S),
            max_rank_faults=_count(e, UNBROKEN_MAX_RANK_FAULTS, 1),
            final_digest=_flag(e, UNBROKEN_FINAL_DIGEST),
        )

    def given(self) -> dict[str, object]:
        """The fields that are set (for the ledger's ``process_start`` record)."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and value != ():
                out[name] = dict(value) if name == "phase_timeouts_s" else value
        return out


# torchrun's worker environment, continued (set by unbroken-run as torchrun does)
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_NAME = "ROLE_NAME"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

# ours, set by unbroken-run for every worker
UNBROKEN_ROUND = "UNBROKEN_ROUND"
"""The globally agreed restart round of the job (also passed as TORCHELASTIC_RESTART_COUNT)."""
UNBROKEN_HEARTBEAT_ADDR = "UNBROKEN_HEARTBEAT_ADDR"
"""host:port of the node agent's heartbeat monitor (UDP); unset outside unbroken-run."""
UNBROKEN_HEARTBEAT_INTERVAL_S = "UNBROKEN_HEARTBEAT_INTERVAL_S"
"""Least seconds between two heartbeat datagrams of one worker (unless its step changed)."""
UNBROKEN_HEARTBEAT_KEY = "UNBROKEN_HEARTBEAT_KEY"
"""The job's heartbeat secret (hex), made by the agent: every datagram carries its HMAC-SHA256,
and the agent ignores datagrams without a valid one (another user's process on the node)."""
UNBROKEN_STORE_ADDR = "UNBROKEN_STORE_ADDR"
"""host:port of an agent-hosted TCPStore that lives for the whole job (coordination store)."""
UNBROKEN_KB = "UNBROKEN_KB"
"""Path of the knowledge base (SQLite) that ``unbroken kb`` and the dashboard use."""
UNBROKEN_AGENT_PID = "UNBROKEN_AGENT_PID"
"""Pid of the node's agent: what a ``node-loss`` fault kills with every process below it."""
UNBROKEN_MEMORY_KEEPER = "UNBROKEN_MEMORY_KEEPER"
"""Unix socket ("@": abstract) of the node agent's memory keeper, which holds every worker's
staging arena so that its snapshots outlive the worker (``unbroken.launcher.keeper``)."""
UNBROKEN_WORKER_STARTED = "UNBROKEN_WORKER_STARTED"
"""``<pid>:<epoch seconds>``: when a standby of the warm pool became this worker (its process
is older); see ``standby_start``."""
UNBROKEN_LINK_FAULTS = "UNBROKEN_LINK_FAULTS"
"""Set ("1") by an emulated cluster whose orchestrator applies ``network`` faults between its
pods (``unbroken.faults.link``); unset, such a fault is recorded as not applied."""


def standby_start(environ: Mapping[str, str] | None = None) -> float | None:
    """When this process became a worker, if it waited as a warm-pool standby (else None: it
    started when it was created). Only for the pid that UNBROKEN_WORKER_STARTED names, so the
    processes a worker starts do not inherit its start."""
    environ = os.environ if environ is None else environ
    pid, _, started = environ.get(UNBROKEN_WORKER_STARTED, "").partition(":")
    if pid != str(os.getpid()):
        return None
    try:
        return float(started)
    except ValueError:
        return None


UNBROKEN_HANDOVER = "UNBROKEN_HANDOVER"
"""A worker's key prefix in the job store under which its agent hands it over to the next round
after another node is lost (``unbroken.restart.handover``); set in multi-node jobs only."""
HANDOVER_READY = "ready"
"""Below a worker's handover prefix: written by the worker once it listens."""
HANDOVER_HOLD = "hold"
"""Written by the agent: leave ``fn`` and wait (by the worker, "release": stop listening)."""
HANDOVER_NEXT = "next"
"""Written by the agent: the worker's environment in the next round, or why it must leave."""
UNBROKEN_PEERS = "UNBROKEN_PEERS"
"""Comma-separated ``host:port#token`` of every node's peer memory service in the round, in
group-rank order (``unbroken.checkpoint.tiers.peers``); a worker replicates its snapshots to the next
node's and restores from any of them."""

# read by the launcher for itself
PET_PREFIX = "PET_"
"""torchrun's defaults for its own flags: ``PET_<DEST>`` (e.g. PET_NPROC_PER_NODE)."""
PYTHON_EXEC = "PYTHON_EXEC"
"""The interpreter of a cold-started worker (torchrun's name; default: this one)."""
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set by the agent for torch: never hand workers the rendezvous store (stale peer keys)."""
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
"""The interface gloo binds (torch's; ``unbroken doctor`` reports it)."""
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The CUDA devices a process sees (``unbroken doctor`` reports it)."""


def lookup(name: str, default: str | None = None) -> str | None:
    """The value of environment variable ``name`` in this process, or ``default``."""
    return os.environ.get(name, default)


def pet_default(dest: str) -> str | None:
    """torchrun's environment default of the flag stored as ``dest`` (``PET_<DEST>``)."""
    return os.environ.get(f"{PET_PREFIX}{dest.upper()}")


def set_for_torch(name: str, value: str) -> None:
    """Set ``name`` in this process's environment, where torch reads it."""
    os.environ[name] = value


@dataclass(frozen=True, kw_only=True)
class HeartbeatEnv:
    """Where a worker sends its heartbeats, as ``unbroken-run`` hands it down."""

    host: str
    """Host of the node agent's heartbeat monitor (UDP)."""
    port: int
    """Its port."""
    rank: int
    """This worker's global rank."""
    local_rank: int
    """Its rank on the node."""
    round: int
    """The restart round it was started in."""
    interval_s: float
    """Least seconds between two datagrams for the same step."""
    key: bytes | None = None
    """The job's heartbeat secret (None: datagrams are sent unsigned)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> HeartbeatEnv | None:
        """None outside ``unbroken-run`` (no monitor address); ValueError for a bad value."""
        e = os.environ if environ is None else environ
        raw = e.get(UNBROKEN_HEARTBEAT_ADDR)
        if not raw:
            return None
        host, _, port = raw.rpartition(":")
        try:
            interval_s = float(e.get(UNBROKEN_HEARTBEAT_INTERVAL_S, "0.5"))
            port_num = int(port)
            key = (
                bytes.fromhex(e[UNBROKEN_HEARTBEAT_KEY]) if e.get(UNBROKEN_HEARTBEAT_KEY) else None
            )
        except ValueError:
            raise ValueError(
                f"{UNBROKEN_HEARTBEAT_ADDR}={raw!r}, {UNBROKEN_HEARTBEAT_INTERVAL_S} or "
                f"{UNBROKEN_HEARTBEAT_KEY} is malformed"
            ) from None
        return cls(
            host=host or "127.0.0.1",
            port=port_num,
            rank=_int(e, RANK, 0),
            local_rank=_int(e, LOCAL_RANK, 0),
            round=_int(e, UNBROKEN_ROUND, 0),
            interval_s=interval_s,
            key=key,
        )
