"""This node's worker processes: environment, start (warm or cold), reaping, stopping.

Every worker is the agent's child: cold starts via ``subprocess.Popen``, warm starts re-parented
from the zygote (the agent is a child subreaper). Each worker leads its own session, so the
agent signals its whole process group. The agent's event loop sleeps in ``select`` on the
heartbeat socket and a self-pipe written by its signal handlers (SIGCHLD and the stop signals),
so a worker's death is seen at once, not at the next poll. Reaping peeks with
``waitid(WNOWAIT)`` and then reaps that one pid, so orphans that land on the subreaper are
reaped too and no other child's status is stolen.

Stopping: SIGTERM then SIGCONT to each group (a stopped process only acts on SIGTERM once
continued), ``stop_grace_s`` to exit, then SIGKILL (which also ends stopped processes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken import env as uenv
from unbroken.launcher import bootstrap, errors
from unbroken.launcher.args import JobSpec
from unbroken.launcher.config import LauncherConfig
from unbroken.launcher.handover import Handed
from unbroken.launcher.keeper import MemoryKeeper
from unbroken.launcher.logs import Tee
from unbroken.launcher.monitor import HeartbeatServer
from unbroken.launcher.rendezvous import RoundInfo
from unbroken.launcher.signals import SignalPipe
from unbroken.launcher.zygote import Zygote

logger = logging.getLogger(__name__)

REAP_AFTER_KILL_S = 10.0


@dataclass(frozen=True, kw_only=True)
class WorkerExit:
    """A reaped worker."""

    local_rank: int
    rank: int
    pid: int
    exit_code: int | None
    """Exit code when it exited, None when a signal ended it."""
    signum: int | None
    """The signal that ended it, if any."""
    ts: float
    """Epoch seconds when the agent reaped it."""
    error_message: str | None = None
    """The message of its elastic error file, if it wrote one."""
    oom_killed: bool = False
    """The cgroup's OOM-kill counter rose while it ran."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class Events:
    """What one wait returned."""

    exits: list[WorkerExit] = field(default_factory=list)
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)


@dataclass
class _Handle:
    local_rank: int
    rank: int
    pid: int
    error_file: Path
    popen: subprocess.Popen[bytes] | None = None
    exit: WorkerExit | None = None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # not a group leader (yet): signal the process itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    except PermissionError:
        pass


_ROUND_ONLY = (uenv.UNBROKEN_PEERS, uenv.UNBROKEN_HANDOVER)
"""Names a round may leave out of a worker's environment (a handed-over worker unsets them)."""


class LocalWorkers:
    """The workers of the current round on this node."""

    def __init__(
        self,
        spec: JobSpec,
        cfg: LauncherConfig,
        *,
        run_dir: Path,
        run_id: str,
        heartbeats: HeartbeatServer,
        signals: SignalPipe,
        zygote: Zygote | None,
        base_env: dict[str, str],
    ) -> None:
        self.spec = spec
        self.cfg = cfg
        self.run_dir = run_dir
        self.run_id = run_id
        self.heartbeats = heartbeats
        self.signals = signals
        self.zygote = zygote
        self.base_env = base_env
        self.keeper = MemoryKeeper()  # the workers' staging arenas, across their deaths
        self.agent_pid = os.getpid()
        self.handles: dict[int, _Handle] = {}
        self._by_pid: dict[int, _Handle] = {}
        self._oom_before: int | None = None
        self._deferred: list[int] = []
        self.tee = Tee()
        self.warm = False
        self.standby = 0
        """How many of the workers last started were the warm pool's standbys."""
        bootstrap.load_libc()  # before any fork: preexec_fn must not load libraries

    def interruptible(self, on: bool) -> None:
        """While on, a stop signal raises AgentSignal (to leave a blocking rendezvous)."""
        self.signals.raise_on_stop = on

    # --- environment -------------------------------------------------------------------------
    def worker_dir(self, info: RoundInfo, rank: int) -> Path:
        base = (
            (self.spec.log_dir / self.run_id) if self.spec.log_dir else (self.run_dir / "launcher")
        )
        return base / f"attempt_{info.round}" / str(rank)

    def worker_env(self, info: RoundInfo, local_rank: int, error_file: Path) -> dict[str, str]:
        """A worker's environment in round ``info``: the agent's, and ``round_env``."""
        return {**self.base_env, **self.round_env(info, local_rank, error_file)}

    def round_env(self, info: RoundInfo, local_rank: int, error_file: Path) -> dict[str, str]:
        """What a worker of round ``info`` is told on top of the agent's environment (all of
        it, also what equals the agent's own: a worker handed over gets exactly this)."""
        rank = info.rank_offset + local_rank
        e: dict[str, str] = {}
        e.update(
            {
                uenv.RANK: str(rank),
                uenv.LOCAL_RANK: str(local_rank),
                uenv.WORLD_SIZE: str(info.world_size),
                uenv.LOCAL_WORLD_SIZE: str(self.spec.nproc_per_node),
                uenv.GROUP_RANK: str(info.group_rank),
                uenv.GROUP_WORLD_SIZE: str(info.group_world_size),
                uenv.ROLE_RANK: str(rank),
                uenv.ROLE_NAME: self.spec.role,
                uenv.ROLE_WORLD_SIZE: str(info.world_size),
                uenv.MASTER_ADDR: info.master_addr,
                uenv.MASTER_PORT: str(info.master_port),
                uenv.RESTART_COUNT: str(info.round),
                uenv.MAX_RESTARTS: str(self.spec.max_restarts),
                uenv.RUN_ID: self.spec.rdzv_id,
                uenv.USE_AGENT_STORE: "True",
                uenv.NCCL_ASYNC_ERROR_HANDLING: os.environ.get(uenv.NCCL_ASYNC_ERROR_HANDLING, "1"),
                uenv.ERROR_FILE: str(error_file),
                uenv.UNBROKEN_ROUND: str(info.round),
                uenv.UNBROKEN_RUN_DIR: str(self.run_dir),
                uenv.UNBROKEN_RUN_ID: self.run_id,
                uenv.UNBROKEN_HEARTBEAT_ADDR: self.heartbeats.addr,
                uenv.UNBROKEN_HEARTBEAT_INTERVAL_S: repr(self.cfg.heartbeat_interval_s),
                uenv.UNBROKEN_HEARTBEAT_KEY: (self.heartbeats.key or b"").hex(),
                uenv.UNBROKEN_STORE_ADDR: info.store_addr,
                uenv.UNBROKEN_AGENT_PID: str(self.agent_pid),
            }
        )
        e[uenv.UNBROKEN_MEMORY_KEEPER] = self.keeper.addr
        if info.peers:
            e[uenv.UNBROKEN_PEERS] = ",".join(info.peers)
        handover = self.handover_prefix(info, local_rank)
        if handover is not None:
            e[uenv.UNBROKEN_HANDOVER] = handover
        return e

    def handover_prefix(self, info: RoundInfo, local_rank: int) -> str | None:
        """A worker's key prefix in the job store for its handover to the next round
        (``unbroken.restart.handover``); None in a single-node job, where no node is lost."""
        if self.spec.max_nodes <= 1:
            return None
        rank = info.rank_offset + local_rank
        return f"unbroken/{self.spec.rdzv_id}/handover/r{info.round}/{rank}/"

    def hand_over(self, info: RoundInfo) -> tuple[dict[int, Handed] | None, list[WorkerExit]]:
        """The running workers become those of round ``info`` (same processes, new ranks).

        Returns:
            Each worker's rank, pid and environment in the round (``round_env``), or None when
            a worker has exited (listed second: the exits reaped here), and then nothing
            changed.
        """
        exits = self._reap()
        if len(self.running()) != self.spec.nproc_per_node:
            return None, exits
        self.keeper.begin_round(info.round)
        out = {}
        for lr, h in self.handles.items():
            h.rank = info.rank_offset + lr
            wdir = self.worker_dir(info, h.rank)
            wdir.mkdir(parents=True, exist_ok=True)
            h.error_file = wdir / "error.json"
            h.error_file.unlink(missing_ok=True)
            env = self.round_env(info, lr, h.error_file)
            unset = [k for k in _ROUND_ONLY if k not in env and k not in self.base_env]
            out[lr] = Handed(h.rank, h.pid, env, unset)
        return out, exits

    # --- start -------------------------------------------------------------------------------
    def start(self, info: RoundInfo) -> dict[int, tuple[int, int]]:
        """Start every local worker of ``info``; ``{local_rank: (rank, pid)}``."""
        self.handles, self._by_pid = {}, {}
        self.keeper.begin_round(info.round)
        self.tee.reset()
        self._oom_before = errors.oom_kill_count()
        reqs = []
        for lr in range(self.spec.nproc_per_node):
            rank = info.rank_offset + lr
            wdir = self.worker_dir(info, rank)
            wdir.mkdir(parents=True, exist_ok=True)
            error_file = wdir / "error.json"
            error_file.unlink(missing_ok=True)
            req: dict[str, Any] = {
                "kind": self.spec.entry.kind,
                "target": self.spec.entry.target,
                "args": list(self.spec.entry.args),
                "cwd": os.getcwd(),
                "env": self.worker_env(info, lr, error_file),
                "rank": rank,
                "local_rank": lr,
                "error_file": str(error_file),
                "stdout": None,
                "stderr": None,
            }
            for bit, name in ((1, "stdout"), (2, "stderr")):
                if (self.spec.std_for("redirects", lr) | self.spec.std_for("tee", lr)) & bit:
                    req[name] = str(wdir / f"{name}.log")
                    if self.spec.std_for("tee", lr) & bit:
                        self.tee.follow(
                            wdir / f"{name}.log", prefix=f"[{self.spec.role}{lr}]:", stream=name
                        )
            reqs.append(req)
        pids = self._spawn_warm(reqs)
        self.warm = pids is not None
        self.standby = self.zygote.standby if self.warm and self.zygote is not None else 0
        if pids is None:
            pids = [self._spawn_cold(req) for req in reqs]
        for req, pid in zip(reqs, pids, strict=True):
            h = self.handles.get(req["local_rank"]) or _Handle(
                local_rank=req["local_rank"],
                rank=req["rank"],
                pid=pid,
                error_file=Path(req["error_file"]),
            )
            self.handles[h.local_rank] = h
            self._by_pid[pid] = h
        return {lr: (h.rank, h.pid) for lr, h in self.handles.items()}

    def _spawn_warm(self, reqs: list[dict[str, Any]]) -> list[int] | None:
        if self.zygote is None or self.zygote.dead or self.spec.entry.kind == "command":
            return None
        try:
            return self.zygote.spawn(reqs, timeout_s=self.cfg.rdzv_timeout_s)
        except errors.LauncherError as e:
            logger.warning("%s; starting workers cold from now on", e)
            return None

    def _spawn_cold(self, req: dict[str, Any]) -> int:
        agent = self.agent_pid

        def preexec() -> None:
            bootstrap.set_pdeathsig(signal.SIGKILL)
            if os.getppid() != agent:
                os._exit(70)

        streams = [
            open(req[n], "ab") if req[n] else None  # noqa: SIM115 - closed below
            for n in ("stdout", "stderr")
        ]
        try:
            popen = subprocess.Popen(
                self.spec.entry.cold_argv(),
                env=req["env"],
                cwd=req["cwd"],
                stdin=subprocess.DEVNULL,
                stdout=streams[0],
                stderr=streams[1],
                start_new_session=True,
                preexec_fn=preexec,
            )
        finally:
            for s in streams:
                if s is not None:
                    s.close()
        h = _Handle(
            local_rank=req["local_rank"],
            rank=req["rank"],
            pid=popen.pid,
            error_file=Path(req["error_file"]),
            popen=popen,
        )
        self.handles[h.local_rank] = h
        return popen.pid

    # --- watching ----------------------------------------------------------------------------
    def wait(self, timeout_s: float) -> Events:
        """Sleep until something happens or ``timeout_s`` passes; reap what exited."""
        with contextlib.suppress(InterruptedError):
            select.select([self.signals.rfd, self.heartbeats.fileno()], [], [], max(0.0, timeout_s))
        sigs = self._deferred + [s for s in self.signals.drain() if s != signal.SIGCHLD]
        self._deferred = []
        return Events(exits=self._reap(), heartbeats=self.heartbeats.drain(), signals=sigs)

    def pending_signal(self) -> int | None:
        """A stop signal that arrived while the agent was not watching (e.g. while stopping)."""
        sigs = self._deferred + [s for s in self.signals.drain() if s != signal.SIGCHLD]
        self._deferred = sigs[1:]
        return sigs[0] if sigs else None

    def _reap(self) -> list[WorkerExit]:
        exits = []
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None:
                break
            try:
                pid, status = os.waitpid(info.si_pid, 0)
            except ChildProcessError:
                continue
            h = self._by_pid.get(pid)
            if h is None:
                if self.zygote is not None and pid == self.zygote.pid:
                    logger.warning(
                        "the warm pool exited (status %d); workers start cold now", status
                    )
                    self.zygote.dead = True
                    self.zygote.proc.returncode = status
                continue  # an orphaned descendant re-parented to us
            exits.append(self._exit_of(h, status))
        return exits

    def _exit_of(self, h: _Handle, status: int) -> WorkerExit:
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = None if signum is not None else os.waitstatus_to_exitcode(status)
        if h.popen is not None:
            h.popen.returncode = -signum if signum is not None else code
        oom = (
            signum == signal.SIGKILL
            and self._oom_before is not None
            and (errors.oom_kill_count() or 0) > self._oom_before
        )
        h.exit = WorkerExit(
            local_rank=h.local_rank,
            rank=h.rank,
            pid=h.pid,
            exit_code=code,
            signum=signum,
            ts=time.time(),
            oom_killed=oom,
            error_message=errors.read_worker_error(h.error_file) if code != 0 else None,
        )
        return h.exit

    def state_of(self, local_rank: int) -> str | None:
        """The kernel's state letter of a running worker (R, S, D, T, ...), or None."""
        h = self.handles.get(local_rank)
        if h is None or h.exit is not None:
            return None
        try:
            return Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None

    def running(self) -> list[int]:
        return [lr for lr, h in self.handles.items() if h.exit is None]

    def all_succeeded(self) -> bool:
        return bool(self.handles) and all(
            h.exit is not None and h.exit.ok for h in self.handles.values()
        )

    # --- stopping ----------------------------------------------------------------------------
    def kill(self, local_ranks: list[int], sig: int) -> None:
        for lr in local_ranks:
            h = self.handles.get(lr)
            if h is not None and h.exit is None:
                _signal_group(h.pid, sig)

    def _wait_all(self, deadline: float, exits: list[WorkerExit]) -> None:
        while self.running() and time.monotonic() < deadline:
            got = self.wait(min(0.05, deadline - time.monotonic()))
            exits.extend(got.exits)
            self._deferred.extend(got.signals)  # for the agent, once the stop is over

    def stop(self, grace_s: float) -> list[WorkerExit]:
        """SIGTERM (+SIGCONT), grace, SIGKILL (at once with no grace); returns the exits
        reaped meanwhile."""
        exits: list[WorkerExit] = []
        live = self.running()
        for sig in (signal.SIGTERM, signal.SIGCONT):
            self.kill(live, sig)
        self._wait_all(time.monotonic() + grace_s, exits)
        if self.running():
            if grace_s > 0:
                logger.warning(
                    "workers %s ignored SIGTERM for %.1f s; sending SIGKILL",
                    self.running(),
                    grace_s,
                )
            self.kill(self.running(), signal.SIGKILL)
            self._wait_all(time.monotonic() + REAP_AFTER_KILL_S, exits)
        for h in self.handles.values():  # whatever the workers left in their groups
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(h.pid, signal.SIGKILL)
        if self.running():
            logger.error("workers %s did not die after SIGKILL", self.running())
        return exits

    def close(self) -> None:
        self.tee.close()
        self.keeper.close()
